//! POSIX ACLs as Linux keeps them in the xattrs `system.posix_acl_access` and
//! `system.posix_acl_default`: their binary format, and the rules that keep an inode's mode
//! and its access ACL in step and hand a directory's default ACL down to what is created in it.
//! These are the rules a local filesystem such as ext4 gets from the kernel's
//! `fs/posix_acl.c`; over FUSE with `FUSE_POSIX_ACL` the kernel enforces stored ACLs but leaves
//! every one of these updates to the filesystem. Pure: no store, no lock, no FUSE type.
//!
//! - setfacl (an access ACL is set): [`Acl::equiv_mode`] gives the new permission bits (owner,
//!   group class = the mask when there is one, other); an ACL the mode says in full is not
//!   stored at all.
//! - chmod: [`Acl::chmod`] rewrites the owner, other and group-class (mask) entries.
//! - create: [`inherit`] applies a directory's default ACL to a new inode in place of the
//!   umask; a new directory also takes the default ACL as its own.

/// The xattr holding an inode's access ACL.
pub const ACCESS: &[u8] = b"system.posix_acl_access";
/// The xattr holding a directory's default ACL.
pub const DEFAULT: &[u8] = b"system.posix_acl_default";

/// Whether `name` is one of the two ACL xattrs.
pub fn is_acl_name(name: &[u8]) -> bool {
    name == ACCESS || name == DEFAULT
}

/// The format version in the xattr's header (`POSIX_ACL_XATTR_VERSION`).
const VERSION: u32 = 2;
/// The id stored for entries that name nobody (`ACL_UNDEFINED_ID`).
const UNDEFINED_ID: u32 = u32::MAX;
const HEADER: usize = 4;
const ENTRY: usize = 8;

/// An entry's kind, in the order a valid ACL lists them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Tag {
    /// The file's owner (`u::`).
    UserObj,
    /// A named user (`u:ID:`).
    User,
    /// The file's group (`g::`).
    GroupObj,
    /// A named group (`g:ID:`).
    Group,
    /// The most the group class (named users, groups, the file's group) may have (`m::`).
    Mask,
    /// Everybody else (`o::`).
    Other,
}

impl Tag {
    fn code(self) -> u16 {
        match self {
            Tag::UserObj => 0x01,
            Tag::User => 0x02,
            Tag::GroupObj => 0x04,
            Tag::Group => 0x08,
            Tag::Mask => 0x10,
            Tag::Other => 0x20,
        }
    }

    fn from_code(c: u16) -> Option<Tag> {
        Some(match c {
            0x01 => Tag::UserObj,
            0x02 => Tag::User,
            0x04 => Tag::GroupObj,
            0x08 => Tag::Group,
            0x10 => Tag::Mask,
            0x20 => Tag::Other,
            _ => return None,
        })
    }

    fn named(self) -> bool {
        matches!(self, Tag::User | Tag::Group)
    }
}

/// One entry: who, and which of read (4), write (2), execute (1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    pub tag: Tag,
    /// The uid or gid of a `User` or `Group` entry; unused by the others.
    pub id: u32,
    pub perm: u32,
}

/// Why bytes are not a valid ACL (what `posix_acl_from_xattr` and `posix_acl_valid` refuse).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AclError {
    #[error("{0} bytes are not a 4-byte header and whole 8-byte entries")]
    Length(usize),
    #[error("version {0}, not 2")]
    Version(u32),
    #[error("no entries")]
    Empty,
    #[error("unknown tag {0:#x}")]
    Tag(u16),
    #[error("permission bits {0:#o} beyond rwx")]
    Perm(u16),
    #[error("a named entry with the undefined id")]
    Id,
    #[error("entries missing, repeated or out of order")]
    Order,
    #[error("named users or groups but no mask")]
    NoMask,
}

/// A valid ACL (see [`Acl::decode`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Acl {
    entries: Vec<Entry>,
}

/// What a new inode gets from its directory's default ACL (see [`inherit`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inherited {
    /// The new inode's mode bits (type bits excluded).
    pub perm: u32,
    /// Its access ACL: `None` when the mode says it all.
    pub access: Option<Acl>,
    /// Its default ACL (directories only): the directory's own.
    pub default: Option<Acl>,
}

impl Acl {
    /// Parses and validates an ACL xattr value. Valid means what the kernel accepts: one
    /// owner, group and other entry, named users after the owner and named groups after the
    /// group, a mask (required with any named entry) before other, nothing after other.
    pub fn decode(bytes: &[u8]) -> Result<Acl, AclError> {
        if bytes.len() < HEADER || (bytes.len() - HEADER) % ENTRY != 0 {
            return Err(AclError::Length(bytes.len()));
        }
        let u32_at = |o: usize| u32::from_le_bytes(bytes[o..o + 4].try_into().expect("4 bytes"));
        let u16_at = |o: usize| u16::from_le_bytes(bytes[o..o + 2].try_into().expect("2 bytes"));
        let version = u32_at(0);
        if version != VERSION {
            return Err(AclError::Version(version));
        }
        let mut entries = Vec::with_capacity((bytes.len() - HEADER) / ENTRY);
        for o in (HEADER..bytes.len()).step_by(ENTRY) {
            let code = u16_at(o);
            let tag = Tag::from_code(code).ok_or(AclError::Tag(code))?;
            let perm = u16_at(o + 2);
            if perm & !7 != 0 {
                return Err(AclError::Perm(perm));
            }
            let id = if tag.named() {
                let id = u32_at(o + 4);
                if id == UNDEFINED_ID {
                    return Err(AclError::Id);
                }
                id
            } else {
                UNDEFINED_ID
            };
            entries.push(Entry {
                tag,
                id,
                perm: u32::from(perm),
            });
        }
        let acl = Acl { entries };
        acl.validate()?;
        Ok(acl)
    }

    /// An ACL from entries, validated as [`Acl::decode`] does.
    pub fn new(entries: Vec<Entry>) -> Result<Acl, AclError> {
        let entries = entries
            .into_iter()
            .map(|e| Entry {
                id: if e.tag.named() { e.id } else { UNDEFINED_ID },
                ..e
            })
            .collect();
        let acl = Acl { entries };
        for e in &acl.entries {
            if e.perm & !7 != 0 {
                return Err(AclError::Perm(e.perm as u16));
            }
            if e.tag.named() && e.id == UNDEFINED_ID {
                return Err(AclError::Id);
            }
        }
        acl.validate()?;
        Ok(acl)
    }

    /// The order rules of `posix_acl_valid`.
    fn validate(&self) -> Result<(), AclError> {
        if self.entries.is_empty() {
            return Err(AclError::Empty);
        }
        // Where the walk is: expecting the owner, named users, named groups, or other.
        #[derive(PartialEq)]
        enum At {
            Start,
            Users,
            Groups,
            BeforeOther,
            Done,
        }
        let mut at = At::Start;
        let mut named = false;
        for e in &self.entries {
            at = match (e.tag, at) {
                (Tag::UserObj, At::Start) => At::Users,
                (Tag::User, At::Users) => {
                    named = true;
                    At::Users
                }
                (Tag::GroupObj, At::Users) => At::Groups,
                (Tag::Group, At::Groups) => {
                    named = true;
                    At::Groups
                }
                (Tag::Mask, At::Groups) => At::BeforeOther,
                (Tag::Other, At::BeforeOther) => At::Done,
                (Tag::Other, At::Groups) if !named => At::Done,
                (Tag::Other, At::Groups) => return Err(AclError::NoMask),
                _ => return Err(AclError::Order),
            };
        }
        if at == At::Done {
            Ok(())
        } else {
            Err(AclError::Order)
        }
    }

    /// The xattr value (what `posix_acl_to_xattr` writes).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER + ENTRY * self.entries.len());
        out.extend_from_slice(&VERSION.to_le_bytes());
        for e in &self.entries {
            out.extend_from_slice(&e.tag.code().to_le_bytes());
            out.extend_from_slice(&(e.perm as u16).to_le_bytes());
            let id = if e.tag.named() { e.id } else { UNDEFINED_ID };
            out.extend_from_slice(&id.to_le_bytes());
        }
        out
    }

    pub fn entries(&self) -> &[Entry] {
        &self.entries
    }

    fn find(&self, tag: Tag) -> Option<&Entry> {
        self.entries.iter().find(|e| e.tag == tag)
    }

    fn find_mut(&mut self, tag: Tag) -> Option<&mut Entry> {
        self.entries.iter_mut().find(|e| e.tag == tag)
    }

    /// Whether the mode bits say all this ACL says (only owner, group and other entries):
    /// such an access ACL is not kept, the mode alone stands for it.
    pub fn is_minimal(&self) -> bool {
        self.entries
            .iter()
            .all(|e| matches!(e.tag, Tag::UserObj | Tag::GroupObj | Tag::Other))
    }

    /// `perm` (a mode's low 12 bits) with its permission bits taken from this ACL, as setting
    /// it as the access ACL makes them: owner from the owner entry, group from the mask when
    /// there is one (else from the group entry), other from the other entry. Set-ID and
    /// sticky bits stay.
    pub fn equiv_mode(&self, perm: u32) -> u32 {
        let bits = |t: Tag| self.find(t).map_or(0, |e| e.perm & 7);
        let group = match self.find(Tag::Mask) {
            Some(m) => m.perm & 7,
            None => bits(Tag::GroupObj),
        };
        (perm & !0o777) | bits(Tag::UserObj) << 6 | group << 3 | bits(Tag::Other)
    }

    /// chmod of an inode with this access ACL to `perm`: owner and other entries take the
    /// new owner and other bits, the mask (or, without one, the group entry) the group bits;
    /// named entries stay.
    pub fn chmod(&mut self, perm: u32) {
        if let Some(e) = self.find_mut(Tag::UserObj) {
            e.perm = (perm >> 6) & 7;
        }
        if let Some(e) = self.find_mut(Tag::Other) {
            e.perm = perm & 7;
        }
        let class = if self.find(Tag::Mask).is_some() {
            Tag::Mask
        } else {
            Tag::GroupObj
        };
        if let Some(e) = self.find_mut(class) {
            e.perm = (perm >> 3) & 7;
        }
    }

    /// A directory's default ACL applied to a new inode asking for `perm`: each of the
    /// owner, other and group-class (mask, else group) entries keeps only the bits both it
    /// and `perm` grant, and `perm`'s permission bits become those entries' (set-ID and
    /// sticky bits stay). Returns the new perm.
    fn create_masq(&mut self, perm: u32) -> u32 {
        let mut mode = perm;
        if let Some(e) = self.find_mut(Tag::UserObj) {
            e.perm &= (perm >> 6) & 7;
            mode = (mode & !0o700) | e.perm << 6;
        }
        if let Some(e) = self.find_mut(Tag::Other) {
            e.perm &= perm & 7;
            mode = (mode & !0o007) | e.perm;
        }
        let class = if self.find(Tag::Mask).is_some() {
            Tag::Mask
        } else {
            Tag::GroupObj
        };
        if let Some(e) = self.find_mut(class) {
            e.perm &= (perm >> 3) & 7;
            mode = (mode & !0o070) | e.perm << 3;
        }
        mode
    }
}

/// What a new inode asking for `perm` (low 12 bits) gets in a directory whose default ACL is
/// `default`: the mode masked by that ACL instead of the umask, an access ACL when the
/// default says more than a mode can (named entries or a mask), and for a directory the
/// default ACL itself.
pub fn inherit(default: &Acl, perm: u32, is_dir: bool) -> Inherited {
    let mut access = default.clone();
    let perm = access.create_masq(perm);
    Inherited {
        perm,
        access: (!access.is_minimal()).then_some(access),
        default: is_dir.then(|| default.clone()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(tag: Tag, id: u32, perm: u32) -> Entry {
        Entry { tag, id, perm }
    }

    /// The ACL of `setfacl`-style text: `u::rwx,u:1000:r-x,g::r--,m::r-x,o::---`.
    fn acl(text: &str) -> Acl {
        let entries = text
            .split(',')
            .map(|part| {
                let f: Vec<&str> = part.split(':').collect();
                let tag = match (f[0], f[1].is_empty()) {
                    ("u", true) => Tag::UserObj,
                    ("u", false) => Tag::User,
                    ("g", true) => Tag::GroupObj,
                    ("g", false) => Tag::Group,
                    ("m", _) => Tag::Mask,
                    ("o", _) => Tag::Other,
                    _ => panic!("bad tag in {part}"),
                };
                let perm = f[2]
                    .chars()
                    .zip([4, 2, 1])
                    .filter(|(c, _)| *c != '-')
                    .map(|(_, b)| b)
                    .sum();
                e(tag, f[1].parse().unwrap_or(UNDEFINED_ID), perm)
            })
            .collect();
        Acl::new(entries).unwrap()
    }

    #[test]
    fn encodes_as_the_kernel_does_and_decodes_back() {
        let a = acl("u::rwx,u:1000:r-x,g::r--,g:50:-w-,m::rwx,o::---");
        let bytes = a.encode();
        // Header, then (tag u16, perm u16, id u32) little-endian; -1 for unnamed entries.
        assert_eq!(&bytes[..4], &[2, 0, 0, 0]);
        assert_eq!(&bytes[4..12], &[1, 0, 7, 0, 0xff, 0xff, 0xff, 0xff]);
        assert_eq!(&bytes[12..20], &[2, 0, 5, 0, 0xe8, 0x03, 0, 0]);
        assert_eq!(&bytes[20..28], &[4, 0, 4, 0, 0xff, 0xff, 0xff, 0xff]);
        assert_eq!(&bytes[28..36], &[8, 0, 2, 0, 50, 0, 0, 0]);
        assert_eq!(&bytes[36..44], &[0x10, 0, 7, 0, 0xff, 0xff, 0xff, 0xff]);
        assert_eq!(&bytes[44..52], &[0x20, 0, 0, 0, 0xff, 0xff, 0xff, 0xff]);
        assert_eq!(bytes.len(), 52);
        assert_eq!(Acl::decode(&bytes).unwrap(), a);
        // An unnamed entry's id is ignored on the way in, written as -1 on the way out.
        let mut odd = acl("u::rw-,g::r--,o::r--").encode();
        odd[8..12].copy_from_slice(&7u32.to_le_bytes());
        assert_eq!(
            Acl::decode(&odd).unwrap().encode(),
            acl("u::rw-,g::r--,o::r--").encode()
        );
    }

    #[test]
    fn refuses_what_the_kernel_refuses() {
        let good = acl("u::rwx,u:5:r--,g::r--,m::r--,o::---").encode();
        let with = |f: &dyn Fn(&mut Vec<u8>)| {
            let mut b = good.clone();
            f(&mut b);
            Acl::decode(&b)
        };
        assert_eq!(
            with(&|b| b.truncate(good.len() - 1)),
            Err(AclError::Length(43))
        );
        assert_eq!(Acl::decode(&[2, 0]), Err(AclError::Length(2)));
        assert_eq!(Acl::decode(&[2, 0, 0, 0]), Err(AclError::Empty));
        assert_eq!(with(&|b| b[0] = 1), Err(AclError::Version(1)));
        assert_eq!(with(&|b| b[4] = 0x40), Err(AclError::Tag(0x40)));
        assert_eq!(with(&|b| b[6] = 8), Err(AclError::Perm(8)));
        assert_eq!(
            with(&|b| b[16..20].copy_from_slice(&u32::MAX.to_le_bytes())),
            Err(AclError::Id)
        );
        let order = |t: &str| {
            let entries = t
                .split(',')
                .map(|x| match x {
                    "u" => e(Tag::UserObj, 0, 7),
                    "U" => e(Tag::User, 9, 7),
                    "g" => e(Tag::GroupObj, 0, 7),
                    "G" => e(Tag::Group, 9, 7),
                    "m" => e(Tag::Mask, 0, 7),
                    "o" => e(Tag::Other, 0, 7),
                    _ => unreachable!(),
                })
                .collect();
            Acl::new(entries).map(|_| ())
        };
        assert_eq!(order("u,g,o"), Ok(()));
        assert_eq!(order("u,g,m,o"), Ok(()));
        assert_eq!(order("u,U,U,g,G,m,o"), Ok(()));
        assert_eq!(order("u,U,g,o"), Err(AclError::NoMask));
        assert_eq!(order("u,g,G,o"), Err(AclError::NoMask));
        assert_eq!(order("g,u,o"), Err(AclError::Order));
        assert_eq!(order("u,u,g,o"), Err(AclError::Order));
        assert_eq!(order("u,g,U,m,o"), Err(AclError::Order));
        assert_eq!(order("u,g,m,m,o"), Err(AclError::Order));
        assert_eq!(order("u,g,o,o"), Err(AclError::Order));
        assert_eq!(order("u,g"), Err(AclError::Order));
        assert_eq!(order("u,o"), Err(AclError::Order));
        assert_eq!(order("u,g,o,m"), Err(AclError::Order));
    }

    #[test]
    fn setfacl_sets_the_mode_from_the_owner_mask_and_other_entries() {
        // setfacl -m u::r--,g::rwx,o::rw- on 0754: a minimal ACL, the mode says it all.
        let a = acl("u::r--,g::rwx,o::rw-");
        assert!(a.is_minimal());
        assert_eq!(a.equiv_mode(0o754), 0o476);
        // Set-ID and sticky bits stay.
        assert_eq!(a.equiv_mode(0o7754), 0o7476);
        // With a mask the group bits are the mask's, and the ACL must be kept.
        let a = acl("u::rwx,u:1000:r-x,g::rwx,m::r--,o::---");
        assert!(!a.is_minimal());
        assert_eq!(a.equiv_mode(0o644), 0o740);
        // A mask with no named entry is more than a mode too.
        assert!(!acl("u::rwx,g::rwx,m::r-x,o::---").is_minimal());
    }

    #[test]
    fn chmod_rewrites_owner_other_and_the_group_class() {
        let mut a = acl("u::rwx,u:1000:rwx,g::r-x,m::rwx,o::r--");
        a.chmod(0o2640);
        assert_eq!(a, acl("u::rw-,u:1000:rwx,g::r-x,m::r--,o::---"));
        assert_eq!(a.equiv_mode(0o2640), 0o2640);
        // Without a mask the group entry follows the group bits.
        let mut a = acl("u::rwx,g::rwx,o::rwx");
        a.chmod(0o751);
        assert_eq!(a, acl("u::rwx,g::r-x,o::--x"));
    }

    #[test]
    fn a_new_file_takes_the_default_acl_instead_of_the_umask() {
        // generic/099: default u::rwx,g::rwx,o::rwx, touch asks for 0666: mode 0666, no ACL.
        let d = acl("u::rwx,g::rwx,o::rwx");
        let got = inherit(&d, 0o666, false);
        assert_eq!(got.perm, 0o666);
        assert_eq!(got.access, None);
        assert_eq!(got.default, None);
        // Default u::r-x,g::r--,o::---: 0666 becomes 0440.
        let got = inherit(&acl("u::r-x,g::r--,o::---"), 0o666, false);
        assert_eq!(got.perm, 0o440);
        assert_eq!(got.access, None);
        // Named entries: the access ACL is the default masked by the mode's group bits.
        let d = acl("u::rwx,u:101:rwx,g::r-x,m::rwx,o::r-x");
        let got = inherit(&d, 0o644, false);
        assert_eq!(got.perm, 0o644);
        assert_eq!(
            got.access,
            Some(acl("u::rw-,u:101:rwx,g::r-x,m::r--,o::r--"))
        );
        // A directory gets the default as its own default too, and keeps set-ID bits.
        let got = inherit(&d, 0o2777, true);
        assert_eq!(got.perm, 0o2775);
        assert_eq!(got.access, Some(d.clone()));
        assert_eq!(got.default, Some(d));
        // vfstest --test-setgid-create-acl: mask rw- takes group execute away.
        let d = acl("u::rwx,g::rw-,m::rw-,o::rwx");
        assert_eq!(inherit(&d, 0o010, false).perm, 0o000);
        assert_eq!(inherit(&d, 0o777, false).perm, 0o767);
    }
}
