//! `ObjectStoreRemote`: the `Remote` trait over the `object_store` crate (S3 and
//! S3-compatible stores such as R2, MinIO and moto; GCS; Azure). A current-thread tokio
//! runtime lives inside; `put_many_absent`/`get_many` run up to `concurrency` requests at
//! once. Credentials come from the standard environment variables (`AWS_ACCESS_KEY_ID`,
//! `AWS_SECRET_ACCESS_KEY`, `AWS_ENDPOINT_URL`, `GOOGLE_SERVICE_ACCOUNT`, `AZURE_*`) and
//! never appear in `describe`.

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use object_store::path::Path as OsPath;
use object_store::{ObjectStore, PutOptions, PutPayload, UpdateVersion};

use super::remote::{ObjectInfo, PutMode, Remote, RemoteError, RemoteResult};
use crate::config::PersistConfig;

pub struct ObjectStoreRemote {
    store: Arc<dyn ObjectStore>,
    /// Key prefix inside the bucket (no leading or trailing `/`).
    prefix: String,
    url: String,
    rt: tokio::runtime::Runtime,
    concurrency: usize,
}

fn classify(op: &'static str, key: &str, e: object_store::Error) -> RemoteError {
    use object_store::Error as E;
    match e {
        E::NotFound { .. } => RemoteError::NotFound {
            key: key.to_string(),
        },
        E::AlreadyExists { .. } => RemoteError::AlreadyExists {
            key: key.to_string(),
        },
        E::Precondition { .. } | E::NotModified { .. } => RemoteError::Precondition {
            key: key.to_string(),
        },
        E::NotSupported { .. }
        | E::NotImplemented
        | E::InvalidPath { .. }
        | E::PermissionDenied { .. }
        | E::Unauthenticated { .. }
        | E::UnknownConfigurationKey { .. } => RemoteError::Permanent {
            op,
            key: key.to_string(),
            reason: e.to_string(),
        },
        // Network errors and 5xx arrive as Generic after object_store's own retries.
        other => RemoteError::Temporary {
            op,
            key: key.to_string(),
            reason: other.to_string(),
        },
    }
}

impl ObjectStoreRemote {
    /// Opens `s3://bucket/prefix`, `gs://bucket/prefix` or `az://container/prefix`.
    pub fn open(url: &str, cfg: &PersistConfig) -> RemoteResult<ObjectStoreRemote> {
        let bad = |reason: String| RemoteError::Open {
            url: url.to_string(),
            reason,
        };
        let (scheme, rest) = url
            .split_once("://")
            .ok_or_else(|| bad("no scheme".into()))?;
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        if bucket.is_empty() {
            return Err(bad("no bucket name".into()));
        }
        let client = object_store::ClientOptions::new()
            .with_timeout(Duration::from_secs(30))
            .with_connect_timeout(Duration::from_secs(5))
            .with_allow_http(cfg.allow_http);
        let retry = object_store::RetryConfig {
            max_retries: 4,
            retry_timeout: Duration::from_secs(60),
            ..Default::default()
        };
        let base = format!("{scheme}://{bucket}");
        let store: Arc<dyn ObjectStore> = match scheme {
            "s3" => {
                let mut b = object_store::aws::AmazonS3Builder::from_env()
                    .with_url(&base)
                    .with_client_options(client)
                    .with_retry(retry)
                    .with_allow_http(cfg.allow_http)
                    .with_virtual_hosted_style_request(!cfg.path_style);
                if let Some(e) = &cfg.endpoint {
                    b = b.with_endpoint(e);
                }
                if let Some(r) = &cfg.region {
                    b = b.with_region(r);
                }
                Arc::new(b.build().map_err(|e| bad(e.to_string()))?)
            }
            "gs" => Arc::new(
                object_store::gcp::GoogleCloudStorageBuilder::from_env()
                    .with_url(&base)
                    .with_client_options(client)
                    .with_retry(retry)
                    .build()
                    .map_err(|e| bad(e.to_string()))?,
            ),
            "az" | "abfs" => {
                let mut b = object_store::azure::MicrosoftAzureBuilder::from_env()
                    .with_url(&base)
                    .with_client_options(client)
                    .with_retry(retry)
                    .with_allow_http(cfg.allow_http);
                if let Some(e) = &cfg.endpoint {
                    b = b.with_endpoint(e.clone());
                }
                Arc::new(b.build().map_err(|e| bad(e.to_string()))?)
            }
            "memory" => Arc::new(object_store::memory::InMemory::new()),
            other => return Err(bad(format!("unsupported scheme `{other}`"))),
        };
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| bad(format!("start I/O runtime: {e}")))?;
        Ok(ObjectStoreRemote {
            store,
            prefix: prefix.trim_matches('/').to_string(),
            url: format!("{scheme}://{bucket}/{}", prefix.trim_matches('/')),
            rt,
            concurrency: cfg.concurrency.max(1),
        })
    }

    fn path(&self, key: &str) -> OsPath {
        if self.prefix.is_empty() {
            OsPath::from(key)
        } else {
            OsPath::from(format!("{}/{key}", self.prefix))
        }
    }

    fn rel(&self, p: &OsPath) -> String {
        let s = p.as_ref();
        if self.prefix.is_empty() {
            s.to_string()
        } else {
            s.strip_prefix(&self.prefix)
                .unwrap_or(s)
                .trim_start_matches('/')
                .to_string()
        }
    }

    fn info(&self, m: &object_store::ObjectMeta) -> ObjectInfo {
        ObjectInfo {
            key: self.rel(&m.location),
            size: m.size,
            modified: SystemTime::from(m.last_modified),
            version: m.e_tag.clone(),
        }
    }

    async fn put_async(
        store: &dyn ObjectStore,
        path: &OsPath,
        key: &str,
        data: Bytes,
        mode: PutMode,
    ) -> RemoteResult<Option<String>> {
        let mode = match mode {
            PutMode::Overwrite => object_store::PutMode::Overwrite,
            PutMode::Create => object_store::PutMode::Create,
            PutMode::Update(v) => object_store::PutMode::Update(UpdateVersion {
                e_tag: Some(v),
                version: None,
            }),
        };
        let opts = PutOptions {
            mode,
            ..Default::default()
        };
        let r = store
            .put_opts(path, PutPayload::from_bytes(data), opts)
            .await
            .map_err(|e| classify("put", key, e))?;
        Ok(r.e_tag)
    }
}

impl Remote for ObjectStoreRemote {
    fn describe(&self) -> String {
        self.url.clone()
    }

    fn get(&self, key: &str) -> RemoteResult<Bytes> {
        let p = self.path(key);
        self.rt.block_on(async {
            let r = self
                .store
                .get(&p)
                .await
                .map_err(|e| classify("get", key, e))?;
            r.bytes().await.map_err(|e| classify("get", key, e))
        })
    }

    fn get_range(&self, key: &str, range: Range<u64>) -> RemoteResult<Bytes> {
        let p = self.path(key);
        self.rt
            .block_on(self.store.get_range(&p, range))
            .map_err(|e| classify("get", key, e))
    }

    fn head(&self, key: &str) -> RemoteResult<Option<ObjectInfo>> {
        let p = self.path(key);
        match self.rt.block_on(self.store.head(&p)) {
            Ok(m) => Ok(Some(self.info(&m))),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(classify("head", key, e)),
        }
    }

    fn put(&self, key: &str, data: Bytes, mode: PutMode) -> RemoteResult<Option<String>> {
        let p = self.path(key);
        self.rt
            .block_on(Self::put_async(self.store.as_ref(), &p, key, data, mode))
    }

    fn delete(&self, key: &str) -> RemoteResult<()> {
        let p = self.path(key);
        match self.rt.block_on(self.store.delete(&p)) {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(classify("delete", key, e)),
        }
    }

    fn list(&self, prefix: &str) -> RemoteResult<Vec<ObjectInfo>> {
        // object_store lists whole path segments: list the directory part, filter the rest.
        let dir = match prefix.rfind('/') {
            Some(i) => &prefix[..i],
            None => "",
        };
        let p = if dir.is_empty() && self.prefix.is_empty() {
            None
        } else {
            Some(self.path(dir))
        };
        let metas: Vec<object_store::ObjectMeta> = self
            .rt
            .block_on(self.store.list(p.as_ref()).try_collect())
            .map_err(|e| classify("list", prefix, e))?;
        let mut out: Vec<ObjectInfo> = metas
            .iter()
            .map(|m| self.info(m))
            .filter(|i| i.key.starts_with(prefix))
            .collect();
        out.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(out)
    }

    fn put_many_absent(&self, items: Vec<(String, Bytes)>) -> RemoteResult<Vec<bool>> {
        let store = self.store.as_ref();
        let jobs = items.into_iter().map(|(k, d)| {
            let p = self.path(&k);
            async move {
                match Self::put_async(store, &p, &k, d, PutMode::Create).await {
                    Ok(_) => Ok(true),
                    Err(RemoteError::AlreadyExists { .. })
                    | Err(RemoteError::Precondition { .. }) => Ok(false),
                    Err(e) => Err(e),
                }
            }
        });
        let r: Vec<RemoteResult<bool>> = self.rt.block_on(
            futures::stream::iter(jobs)
                .buffered(self.concurrency)
                .collect(),
        );
        r.into_iter().collect()
    }

    fn get_many(&self, keys: &[String]) -> Vec<RemoteResult<Bytes>> {
        let store = self.store.as_ref();
        let jobs = keys.iter().map(|k| {
            let p = self.path(k);
            async move {
                let r = store.get(&p).await.map_err(|e| classify("get", k, e))?;
                r.bytes().await.map_err(|e| classify("get", k, e))
            }
        });
        self.rt.block_on(
            futures::stream::iter(jobs)
                .buffered(self.concurrency)
                .collect(),
        )
    }
}
