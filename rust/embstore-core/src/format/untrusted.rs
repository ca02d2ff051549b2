//! Opening the files of a checkpoint directory, which is untrusted input:
//! another process, a copied archive or a hostile user may have put a FIFO,
//! a device or a symbolic link where a file is expected.
//!
//! Every open here is non-blocking (a FIFO opens at once instead of waiting
//! for a writer), never follows a symbolic link in the file's own name (the
//! directory the user named may be one), and is checked on the open
//! descriptor (`fstat`, so nothing can be swapped in between the check and
//! the read) to be a regular file before a byte is read or written.

use std::fs::{File, OpenOptions};
use std::io;
#[cfg(unix)]
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// The flags every open of a file inside a checkpoint directory takes.
#[cfg(unix)]
const FLAGS: i32 = libc::O_NONBLOCK | libc::O_NOFOLLOW;

fn with_flags(o: &mut OpenOptions) -> &mut OpenOptions {
    #[cfg(unix)]
    o.custom_flags(FLAGS);
    o
}

/// The error an open of a symbolic link gives, said as what it is.
fn explain(e: io::Error) -> io::Error {
    #[cfg(unix)]
    if e.raw_os_error() == Some(libc::ELOOP) {
        return io::Error::other("a symbolic link (not followed)");
    }
    e
}

/// `f` if it is a regular file (checked on the descriptor).
fn regular(f: File) -> io::Result<File> {
    if f.metadata()?.is_file() {
        Ok(f)
    } else {
        Err(io::Error::other("not a regular file"))
    }
}

/// Why `name` is not a plain file name inside a checkpoint directory
/// (`None`: it is one). A manifest names its files; a name with a
/// separator, a `..`, a leading dot or a NUL could reach outside the
/// directory or onto its lock file, so it is refused before any open.
pub(crate) fn not_plain(name: &str) -> Option<&'static str> {
    if name.is_empty() {
        Some("empty")
    } else if name.len() > 255 {
        Some("longer than 255 bytes")
    } else if name.contains(['/', '\\', '\0']) {
        Some("holds a path separator or a NUL")
    } else if name.starts_with('.') {
        Some("starts with a dot")
    } else {
        None
    }
}

/// Opens the file `name` of the checkpoint directory `dir` for reading:
/// the one way a file a manifest names is opened (by a load, the mapped
/// reader, `inspect` and a save's checks). `name` must be a plain name
/// ([`not_plain`]), so nothing outside `dir` is opened, stat'ed or
/// described in an error; then as [`open_file`].
///
/// # Errors
/// `InvalidInput` for a name that is not plain; otherwise as [`open_file`].
pub(crate) fn open_in(dir: &Path, name: &str) -> io::Result<File> {
    if let Some(why) = not_plain(name) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("the manifest names {name:?}, which is not a plain file name ({why})"),
        ));
    }
    open_file(&dir.join(name))
}

/// Opens the existing regular file at `path` for reading.
///
/// # Errors
/// The open's error; a symbolic link, a FIFO, a device, a socket or a
/// directory is refused without blocking.
pub(crate) fn open_file(path: &Path) -> io::Result<File> {
    regular(
        with_flags(OpenOptions::new().read(true))
            .open(path)
            .map_err(explain)?,
    )
}

/// Creates the file at `path`, which must not exist (not even as a
/// symbolic link or a dangling one), for writing.
///
/// # Errors
/// The open's error (`AlreadyExists` when anything is at `path`).
pub(crate) fn create_file(path: &Path) -> io::Result<File> {
    with_flags(OpenOptions::new().write(true).create_new(true))
        .open(path)
        .map_err(explain)
}

/// Opens the regular file at `path`, creating it empty if nothing is
/// there (for a lock file, which holds no data).
///
/// # Errors
/// The open's error, or `path` naming something other than a regular file.
pub(crate) fn open_or_create_file(path: &Path) -> io::Result<File> {
    regular(
        with_flags(OpenOptions::new().append(true).create(true))
            .open(path)
            .map_err(explain)?,
    )
}

/// Opens the directory at `path` (following a link to it: it is the path
/// the caller named), without blocking if it is something else.
///
/// # Errors
/// The open's error, or `path` not being a directory.
pub(crate) fn open_dir(path: &Path) -> io::Result<File> {
    let mut o = OpenOptions::new();
    o.read(true);
    #[cfg(unix)]
    o.custom_flags(libc::O_NONBLOCK | libc::O_DIRECTORY);
    let f = o.open(path)?;
    if f.metadata()?.is_dir() {
        Ok(f)
    } else {
        Err(io::Error::other("not a directory"))
    }
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::time::{Duration, Instant};

    fn temp(name: &str) -> std::path::PathBuf {
        let d =
            std::env::temp_dir().join(format!("embstore-untrusted-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn mkfifo(p: &Path) {
        let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: `c` is a NUL-terminated path that lives across the call.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
    }

    #[test]
    fn a_fifo_is_refused_at_once_for_reading_and_for_locking() {
        let d = temp("fifo");
        let p = d.join("f");
        mkfifo(&p);
        let t = Instant::now();
        let e = open_file(&p).unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{e}");
        assert!(open_or_create_file(&p).is_err());
        assert!(open_dir(&p).is_err());
        assert!(t.elapsed() < Duration::from_secs(5), "an open blocked");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn symbolic_links_are_not_followed_nor_created_through() {
        let d = temp("link");
        let outside = d.join("outside");
        std::fs::write(&outside, b"secret").unwrap();
        let inside = d.join("ckpt");
        std::fs::create_dir(&inside).unwrap();
        std::os::unix::fs::symlink(&outside, inside.join("a")).unwrap();
        let e = open_file(&inside.join("a")).unwrap_err().to_string();
        assert!(e.contains("symbolic link"), "{e}");
        // A dangling link: creating through it would make a file outside.
        let target = d.join("made-outside");
        std::os::unix::fs::symlink(&target, inside.join("b")).unwrap();
        assert!(open_or_create_file(&inside.join("b")).is_err());
        assert!(create_file(&inside.join("b")).is_err());
        assert!(!target.exists(), "a file was created outside the directory");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn regular_files_read_write_and_create() {
        let d = temp("regular");
        let mut f = create_file(&d.join("x")).unwrap();
        f.write_all(b"abc").unwrap();
        assert!(
            create_file(&d.join("x")).is_err(),
            "create_file never overwrites"
        );
        let mut s = String::new();
        open_file(&d.join("x"))
            .unwrap()
            .read_to_string(&mut s)
            .unwrap();
        assert_eq!(s, "abc");
        open_or_create_file(&d.join("lock")).unwrap();
        assert!(d.join("lock").is_file());
        assert!(open_dir(&d).is_ok());
        assert!(open_file(&d).is_err(), "a directory is not a regular file");
        std::fs::remove_dir_all(&d).unwrap();
    }
}
