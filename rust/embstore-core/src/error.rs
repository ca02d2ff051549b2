//! The one error type of the core. The binding maps each variant to a Python
//! exception class in one place (`embstore-py/src/error.rs`).

use std::fmt;

/// Why a call was refused. A refused call has changed nothing.
#[derive(Debug, Clone, PartialEq)]
pub enum StoreError {
    /// An argument had a value outside its allowed range; the message names the
    /// argument and what was expected.
    InvalidArgument {
        /// The argument's name as the user spells it.
        arg: &'static str,
        /// What was expected, and what was given.
        msg: String,
    },
    /// Two arguments whose lengths must agree do not.
    ShapeMismatch {
        /// The argument's name.
        arg: &'static str,
        /// Expected number of elements.
        expected: usize,
        /// Number given.
        got: usize,
    },
    /// A gradient, value or weight was NaN or infinite.
    NonFinite {
        /// The argument holding the bad value.
        arg: &'static str,
        /// Flat index of the first bad element.
        index: usize,
    },
    /// `apply_gradients` on a table built without an optimizer.
    NoOptimizer,
    /// Memory that the call needs could not be allocated (or is more than
    /// the process may use); nothing changed.
    OutOfMemory {
        /// The argument whose size asked for the memory.
        arg: &'static str,
        /// Bytes asked for.
        bytes: u128,
    },
    /// A checkpoint could not be written, or is damaged, unknown or does not
    /// fit; nothing was loaded (or published).
    Checkpoint {
        /// The file or directory concerned.
        path: String,
        /// What is wrong.
        msg: String,
    },
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreError::InvalidArgument { arg, msg } => write!(f, "{arg}: {msg}"),
            StoreError::ShapeMismatch { arg, expected, got } => {
                write!(f, "{arg}: expected {expected} elements, got {got}")
            }
            StoreError::NonFinite { arg, index } => write!(
                f,
                "{arg}: expected only finite values, found NaN or inf at flat index {index}"
            ),
            StoreError::Checkpoint { path, msg } => write!(f, "checkpoint {path}: {msg}"),
            StoreError::OutOfMemory { arg, bytes } => write!(
                f,
                "{arg}: needs {bytes} bytes of memory, more than could be allocated; nothing changed"
            ),
            StoreError::NoOptimizer => write!(
                f,
                "optimizer: this table was built with optimizer=None; pass an optimizer to train it"
            ),
        }
    }
}

impl std::error::Error for StoreError {}

/// Result alias of the core.
pub type Result<T> = std::result::Result<T, StoreError>;

/// Shorthand for [`StoreError::InvalidArgument`].
pub(crate) fn invalid(arg: &'static str, msg: impl Into<String>) -> StoreError {
    StoreError::InvalidArgument {
        arg,
        msg: msg.into(),
    }
}

/// Shorthand for [`StoreError::Checkpoint`].
pub(crate) fn ckpt_err(path: impl AsRef<std::path::Path>, msg: impl Into<String>) -> StoreError {
    StoreError::Checkpoint {
        path: path.as_ref().display().to_string(),
        msg: msg.into(),
    }
}

/// Shorthand for [`StoreError::OutOfMemory`].
pub fn oom(arg: &'static str, bytes: impl TryInto<u128>) -> StoreError {
    StoreError::OutOfMemory {
        arg,
        bytes: bytes.try_into().unwrap_or(u128::MAX),
    }
}
