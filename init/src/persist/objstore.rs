//! `ObjectStoreRemote`: the `Remote` trait over the `object_store` crate (S3 and
//! S3-compatible stores such as R2, MinIO and moto; GCS; Azure). A current-thread tokio
//! runtime lives inside; `put_many_absent`/`get_many` run up to `concurrency` requests at
//! once. Credentials come from the standard environment variables (`AWS_ACCESS_KEY_ID`,
//! `AWS_SECRET_ACCESS_KEY`, `AWS_ENDPOINT_URL`, `GOOGLE_SERVICE_ACCOUNT`, `AZURE_*`), overridden
//! by the same names in `[persist] credentials_file`, and never appear in `describe` or in error strings. Every request that fails for a
//! temporary reason is retried here (`retrying`), within the deadline of the calling
//! thread's work (`retry::deadline_scope`).

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use object_store::path::Path as OsPath;
use object_store::{ObjectStore, PutOptions, PutPayload, UpdateVersion};

use super::remote::{ObjectInfo, PutMode, Remote, RemoteError, RemoteResult};
use super::retry::{current_deadline, redact, RetryPolicy};
use crate::config::PersistConfig;

pub struct ObjectStoreRemote {
    store: Arc<dyn ObjectStore>,
    /// Key prefix inside the bucket (no leading or trailing `/`).
    prefix: String,
    url: String,
    rt: tokio::runtime::Runtime,
    concurrency: usize,
    retry: RetryPolicy,
}

/// Maps an `object_store` error onto `RemoteError`: temporary (network errors, timeouts,
/// 5xx, 408, 429 and throttling) or permanent (other 4xx: credentials, permissions,
/// validation; a missing bucket). The reason is redacted (no credentials, no signed URLs).
fn classify(op: &'static str, key: &str, e: object_store::Error) -> RemoteError {
    use object_store::Error as E;
    let key = key.to_string();
    match e {
        E::NotFound { .. } => RemoteError::NotFound { key },
        E::AlreadyExists { .. } => RemoteError::AlreadyExists { key },
        E::Precondition { .. } | E::NotModified { .. } => RemoteError::Precondition { key },
        E::NotSupported { .. }
        | E::NotImplemented
        | E::InvalidPath { .. }
        | E::PermissionDenied { .. }
        | E::Unauthenticated { .. }
        | E::UnknownConfigurationKey { .. } => RemoteError::Permanent {
            op,
            key,
            reason: redact(&e.to_string()),
        },
        other => {
            let text = chain_text(&other);
            let reason = redact(&text);
            if is_temporary_text(&text) {
                RemoteError::Temporary { op, key, reason }
            } else {
                RemoteError::Permanent { op, key, reason }
            }
        }
    }
}

/// An error and its sources, `: `-separated (each source only when it adds something).
fn chain_text(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut at = e.source();
    while let Some(s) = at {
        let t = s.to_string();
        if !text.contains(&t) {
            text.push_str(": ");
            text.push_str(&t);
        }
        at = s.source();
    }
    text
}

/// Whether an error that `object_store` did not type (it arrives as `Generic`) may go away
/// by itself: judged by the HTTP status it names, else by the S3/Azure/GCS error code in
/// the body; without either it is a transport error (refused, reset, timed out): temporary.
fn is_temporary_text(text: &str) -> bool {
    if let Some(i) = text.find("status code: ") {
        let digits: String = text[i + 13..].chars().take(3).collect();
        if let Ok(code) = digits.parse::<u16>() {
            return code >= 500 || code == 408 || code == 429;
        }
    }
    const PERMANENT: &[&str] = &[
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "NoSuchBucket",
        "InvalidBucketName",
        "AuthorizationHeaderMalformed",
        "InvalidArgument",
        "InvalidRequest",
        "AuthenticationFailed",
        "AuthorizationFailure",
        "ContainerNotFound",
        "Bad Request",
        "Forbidden",
        "Unauthorized",
    ];
    !PERMANENT.iter().any(|p| text.contains(p))
}

/// Runs one remote request, retrying temporary failures with `policy` (backoff with full
/// jitter), never past `deadline`: a request still running at the deadline is abandoned.
async fn retrying<T, F, Fut>(
    policy: RetryPolicy,
    deadline: Option<Instant>,
    op: &'static str,
    key: &str,
    mut attempt: F,
) -> RemoteResult<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = RemoteResult<T>>,
{
    let mut retry = 0u32;
    loop {
        let r = match deadline {
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                match tokio::time::timeout(left, attempt()).await {
                    Ok(r) => r,
                    Err(_) => Err(RemoteError::Temporary {
                        op,
                        key: key.to_string(),
                        reason: "deadline passed while the request was in flight".into(),
                    }),
                }
            }
            None => attempt().await,
        };
        match r {
            Err(e) if e.is_temporary() => {
                let sleep = policy.backoff(retry);
                let late = deadline.is_some_and(|d| Instant::now() + sleep >= d);
                let give_up = retry + 1 >= policy.attempts || late;
                super::metrics::remote_error(op, &e, !give_up);
                if give_up {
                    return Err(match e {
                        RemoteError::Temporary { op, key, reason } => RemoteError::Temporary {
                            op,
                            key,
                            reason: format!(
                                "{reason} (gave up after {} tr{}{})",
                                retry + 1,
                                if retry == 0 { "y" } else { "ies" },
                                if late { ", deadline" } else { "" }
                            ),
                        },
                        e => e,
                    });
                }
                tracing::debug!(op, key, error = %e, retry, "temporary remote error; retrying");
                tokio::time::sleep(sleep).await;
                retry += 1;
            }
            Err(e) => {
                super::metrics::remote_error(op, &e, false);
                return Err(e);
            }
            r => return r,
        }
    }
}

impl ObjectStoreRemote {
    /// Creates each object if absent, `concurrency` at a time; one that exists is left alone,
    /// or with `rewrite` written again (a fresh Last-Modified). Returns, in input order,
    /// whether each was absent.
    fn put_many_create(
        &self,
        items: Vec<(String, Bytes)>,
        rewrite: bool,
    ) -> RemoteResult<Vec<bool>> {
        let store = self.store.as_ref();
        let (policy, deadline) = (self.retry, current_deadline());
        let jobs = items.into_iter().map(|(k, d)| {
            let p = self.path(&k);
            async move {
                let put = |mode: PutMode| {
                    let (p, k, d) = (&p, &k, &d);
                    retrying(policy, deadline, "put", k, move || {
                        Self::put_async(store, p, k, d.clone(), mode.clone())
                    })
                };
                match put(PutMode::Create).await {
                    Ok(_) => Ok(true),
                    Err(RemoteError::AlreadyExists { .. })
                    | Err(RemoteError::Precondition { .. }) => {
                        if rewrite {
                            put(PutMode::Overwrite).await?;
                        }
                        Ok(false)
                    }
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
        // Retries happen in `retrying`, which knows the deadline of the work at hand.
        let retry = object_store::RetryConfig {
            max_retries: 0,
            retry_timeout: Duration::from_secs(60),
            ..Default::default()
        };
        let base = format!("{scheme}://{bucket}");
        // `[persist] credentials_file` wins over the environment (read once per process).
        let creds = crate::config::credentials::for_config(cfg).map_err(|e| bad(e.to_string()))?;
        // Variables `keel run` took out of its environment at start come first, the file's after.
        let from_file = |prefix: &'static str| {
            crate::config::credentials::taken_with_prefix(prefix)
                .chain(creds.into_iter().flat_map(move |c| c.with_prefix(prefix)))
                .map(|(k, v)| (k.to_ascii_lowercase(), v))
        };
        let store: Arc<dyn ObjectStore> = match scheme {
            "s3" => {
                let mut b = object_store::aws::AmazonS3Builder::from_env()
                    .with_url(&base)
                    .with_client_options(client)
                    .with_retry(retry)
                    .with_allow_http(cfg.allow_http)
                    .with_virtual_hosted_style_request(!cfg.path_style);
                for (k, v) in from_file("AWS_") {
                    if let Ok(key) = k.parse::<object_store::aws::AmazonS3ConfigKey>() {
                        b = b.with_config(key, v);
                    }
                }
                if let Some(e) = &cfg.endpoint {
                    b = b.with_endpoint(e);
                }
                if let Some(r) = &cfg.region {
                    b = b.with_region(r);
                }
                Arc::new(b.build().map_err(|e| bad(e.to_string()))?)
            }
            "gs" => {
                let mut b = object_store::gcp::GoogleCloudStorageBuilder::from_env()
                    .with_url(&base)
                    .with_client_options(client)
                    .with_retry(retry);
                for (k, v) in from_file("GOOGLE_") {
                    if let Ok(key) = k.parse::<object_store::gcp::GoogleConfigKey>() {
                        b = b.with_config(key, v);
                    }
                }
                Arc::new(b.build().map_err(|e| bad(e.to_string()))?)
            }
            "az" | "abfs" => {
                let mut b = object_store::azure::MicrosoftAzureBuilder::from_env()
                    .with_url(&base)
                    .with_client_options(client)
                    .with_retry(retry)
                    .with_allow_http(cfg.allow_http);
                for (k, v) in from_file("AZURE_") {
                    if let Ok(key) = k.parse::<object_store::azure::AzureConfigKey>() {
                        b = b.with_config(key, v);
                    }
                }
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
            retry: RetryPolicy::default(),
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
        let store = self.store.as_ref();
        self.rt.block_on(retrying(
            self.retry,
            current_deadline(),
            "get",
            key,
            || async {
                let r = store.get(&p).await.map_err(|e| classify("get", key, e))?;
                r.bytes().await.map_err(|e| classify("get", key, e))
            },
        ))
    }

    fn get_range(&self, key: &str, range: Range<u64>) -> RemoteResult<Bytes> {
        let p = self.path(key);
        let store = self.store.as_ref();
        self.rt.block_on(retrying(
            self.retry,
            current_deadline(),
            "get",
            key,
            || async {
                store
                    .get_range(&p, range.clone())
                    .await
                    .map_err(|e| classify("get", key, e))
            },
        ))
    }

    fn head(&self, key: &str) -> RemoteResult<Option<ObjectInfo>> {
        let p = self.path(key);
        let store = self.store.as_ref();
        self.rt.block_on(retrying(
            self.retry,
            current_deadline(),
            "head",
            key,
            || async {
                match store.head(&p).await {
                    Ok(m) => Ok(Some(self.info(&m))),
                    Err(object_store::Error::NotFound { .. }) => Ok(None),
                    Err(e) => Err(classify("head", key, e)),
                }
            },
        ))
    }

    fn put(&self, key: &str, data: Bytes, mode: PutMode) -> RemoteResult<Option<String>> {
        let p = self.path(key);
        let store = self.store.as_ref();
        self.rt
            .block_on(retrying(self.retry, current_deadline(), "put", key, || {
                Self::put_async(store, &p, key, data.clone(), mode.clone())
            }))
    }

    fn delete(&self, key: &str) -> RemoteResult<()> {
        let p = self.path(key);
        let store = self.store.as_ref();
        self.rt.block_on(retrying(
            self.retry,
            current_deadline(),
            "delete",
            key,
            || async {
                match store.delete(&p).await {
                    Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
                    Err(e) => Err(classify("delete", key, e)),
                }
            },
        ))
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
        let store = self.store.as_ref();
        let metas: Vec<object_store::ObjectMeta> = self.rt.block_on(retrying(
            self.retry,
            current_deadline(),
            "list",
            prefix,
            || async {
                store
                    .list(p.as_ref())
                    .try_collect()
                    .await
                    .map_err(|e| classify("list", prefix, e))
            },
        ))?;
        let mut out: Vec<ObjectInfo> = metas
            .iter()
            .map(|m| self.info(m))
            .filter(|i| i.key.starts_with(prefix))
            .collect();
        out.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(out)
    }

    fn put_many_absent(&self, items: Vec<(String, Bytes)>) -> RemoteResult<Vec<bool>> {
        self.put_many_create(items, false)
    }

    fn put_many_fresh(&self, items: Vec<(String, Bytes)>) -> RemoteResult<Vec<bool>> {
        // No portable way to touch an object (S3 refuses a copy onto itself that changes
        // nothing): one that exists is written again, which gives it a new Last-Modified.
        self.put_many_create(items, true)
    }

    fn get_many(&self, keys: &[String]) -> Vec<RemoteResult<Bytes>> {
        let store = self.store.as_ref();
        let (policy, deadline) = (self.retry, current_deadline());
        let jobs = keys.iter().map(|k| {
            let p = self.path(k);
            async move {
                retrying(policy, deadline, "get", k, || async {
                    let r = store.get(&p).await.map_err(|e| classify("get", k, e))?;
                    r.bytes().await.map_err(|e| classify("get", k, e))
                })
                .await
            }
        });
        self.rt.block_on(
            futures::stream::iter(jobs)
                .buffered(self.concurrency)
                .collect(),
        )
    }

    fn get_ranges(&self, reqs: &[(String, Range<u64>)]) -> Vec<RemoteResult<Bytes>> {
        let store = self.store.as_ref();
        let (policy, deadline) = (self.retry, current_deadline());
        let jobs = reqs.iter().map(|(k, range)| {
            let p = self.path(k);
            async move {
                retrying(policy, deadline, "get", k, || async {
                    store
                        .get_range(&p, range.clone())
                        .await
                        .map_err(|e| classify("get", k, e))
                })
                .await
            }
        });
        self.rt.block_on(
            futures::stream::iter(jobs)
                .buffered(self.concurrency)
                .collect(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn put_many_fresh_rewrites_what_exists_and_put_many_absent_does_not() {
        let r = ObjectStoreRemote::open("memory://b/p", &PersistConfig::default()).unwrap();
        let item = || vec![("k".to_string(), Bytes::from_static(b"chunk"))];
        assert_eq!(r.put_many_fresh(item()).unwrap(), [true]);
        let t1 = r.head("k").unwrap().unwrap().modified;
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(r.put_many_absent(item()).unwrap(), [false]);
        assert_eq!(r.head("k").unwrap().unwrap().modified, t1);
        assert_eq!(r.put_many_fresh(item()).unwrap(), [false]);
        let t2 = r.head("k").unwrap().unwrap().modified;
        assert!(t2 > t1, "{t1:?} {t2:?}");
        assert_eq!(r.get("k").unwrap(), Bytes::from_static(b"chunk"));
    }

    #[test]
    fn classifies_generic_errors_by_status_and_code() {
        for t in [
            "Error performing PUT http://h/k in 1ms - Server returned non-2xx status code: 503 Service Unavailable: ",
            "Error performing PUT http://h/k in 1ms - Server returned non-2xx status code: 429 Too Many Requests: ",
            "Error performing GET http://h/k in 1ms - Server returned non-2xx status code: 500 Internal Server Error: ",
            "Error performing GET http://h/k in 30s - HTTP error: error sending request: operation timed out",
            "Error performing GET http://h/k in 1ms - HTTP error: error sending request: connection refused",
            "Server returned error response: <Error><Code>SlowDown</Code></Error>",
        ] {
            assert!(is_temporary_text(t), "{t}");
        }
        for t in [
            "Error performing PUT http://h/k in 1ms - Server returned non-2xx status code: 400 Bad Request: ",
            "Server returned error response: <Error><Code>InvalidAccessKeyId</Code></Error>",
            "Server returned error response: <Error><Code>NoSuchBucket</Code></Error>",
        ] {
            assert!(!is_temporary_text(t), "{t}");
        }
    }

    #[test]
    fn retries_temporary_errors_until_they_pass_and_never_past_the_deadline() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let policy = RetryPolicy {
            attempts: 5,
            base: Duration::from_millis(1),
            cap: Duration::from_millis(5),
        };
        let temp = || RemoteError::Temporary {
            op: "put",
            key: "k".into(),
            reason: "connection reset".into(),
        };
        // Two failures, then success.
        let mut n = 0;
        let r = rt.block_on(retrying(policy, None, "put", "k", || {
            n += 1;
            let fail = n <= 2;
            async move {
                if fail {
                    Err(temp())
                } else {
                    Ok(n)
                }
            }
        }));
        assert_eq!(r.unwrap(), 3);
        // Always failing: exactly `attempts` tries, then the error says so.
        let mut n = 0;
        let r: RemoteResult<()> = rt.block_on(retrying(policy, None, "put", "k", || {
            n += 1;
            async { Err(temp()) }
        }));
        assert_eq!(n, 5);
        assert!(r.unwrap_err().to_string().contains("gave up after 5 tries"));
        // Permanent errors are not retried.
        let mut n = 0;
        let r: RemoteResult<()> = rt.block_on(retrying(policy, None, "put", "k", || {
            n += 1;
            async {
                Err(RemoteError::Permanent {
                    op: "put",
                    key: "k".into(),
                    reason: "403".into(),
                })
            }
        }));
        assert!(r.is_err());
        assert_eq!(n, 1);
        // A request hanging past the deadline is abandoned at the deadline.
        let t0 = Instant::now();
        let slow = RetryPolicy {
            attempts: 100,
            base: Duration::from_millis(50),
            cap: Duration::from_millis(50),
        };
        let r: RemoteResult<()> = rt.block_on(retrying(
            slow,
            Some(t0 + Duration::from_millis(300)),
            "get",
            "k",
            || async {
                tokio::time::sleep(Duration::from_secs(60)).await;
                Ok(())
            },
        ));
        assert!(r.unwrap_err().to_string().contains("deadline"));
        // A hang guard: without the deadline the request would take its full minute.
        assert!(t0.elapsed() < Duration::from_secs(45));
    }
}
