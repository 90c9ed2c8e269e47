//! [`KeyPart`]: what can be one part of an operation key, and its canonical bytes for the
//! types the crate knows.

use std::borrow::Cow;
use std::sync::Arc;

/// A value that can be one part of an operation key.
///
/// Implemented for strings, byte strings, integers, `bool` and `char`, and through
/// references, `Box`, `Rc`, `Arc` and `Cow`. Implement it for your own identifier types by
/// writing their canonical bytes.
///
/// ```
/// use idempotent_runtime::KeyPart;
///
/// struct OrderId(u64);
///
/// impl KeyPart for OrderId {
///     fn write_key_part(&self, out: &mut Vec<u8>) {
///         self.0.write_key_part(out)
///     }
/// }
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be part of an idempotency key",
    label = "this is not a key part",
    note = "key parts are business identifiers: strings, byte strings, integers, `bool`, `char`, or a type that implements `idempotency::KeyPart`"
)]
pub trait KeyPart {
    /// Appends this part's canonical bytes to `out`.
    ///
    /// Two values that mean the same business identifier must write the same bytes, and two
    /// that differ must write different bytes.
    fn write_key_part(&self, out: &mut Vec<u8>);
}

impl KeyPart for str {
    fn write_key_part(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(self.as_bytes());
    }
}

impl KeyPart for String {
    fn write_key_part(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(self.as_bytes());
    }
}

impl KeyPart for [u8] {
    fn write_key_part(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(self);
    }
}

impl<const N: usize> KeyPart for [u8; N] {
    fn write_key_part(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(self);
    }
}

impl KeyPart for Vec<u8> {
    fn write_key_part(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(self);
    }
}

impl KeyPart for bool {
    fn write_key_part(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(if *self { b"true" } else { b"false" });
    }
}

impl KeyPart for char {
    fn write_key_part(&self, out: &mut Vec<u8>) {
        let mut buf = [0u8; 4];
        out.extend_from_slice(self.encode_utf8(&mut buf).as_bytes());
    }
}

macro_rules! int_key_part {
    ($($t:ty)*) => {$(
        impl KeyPart for $t {
            fn write_key_part(&self, out: &mut Vec<u8>) {
                use std::io::Write as _;
                // Writing into a Vec cannot fail.
                let _ = write!(out, "{}", self);
            }
        }
    )*};
}
int_key_part!(u8 u16 u32 u64 u128 usize i8 i16 i32 i64 i128 isize);

impl<T: KeyPart + ?Sized> KeyPart for &T {
    fn write_key_part(&self, out: &mut Vec<u8>) {
        (**self).write_key_part(out)
    }
}

impl<T: KeyPart + ?Sized> KeyPart for &mut T {
    fn write_key_part(&self, out: &mut Vec<u8>) {
        (**self).write_key_part(out)
    }
}

impl<T: KeyPart + ?Sized> KeyPart for Box<T> {
    fn write_key_part(&self, out: &mut Vec<u8>) {
        (**self).write_key_part(out)
    }
}

impl<T: KeyPart + ?Sized> KeyPart for std::rc::Rc<T> {
    fn write_key_part(&self, out: &mut Vec<u8>) {
        (**self).write_key_part(out)
    }
}

impl<T: KeyPart + ?Sized> KeyPart for Arc<T> {
    fn write_key_part(&self, out: &mut Vec<u8>) {
        (**self).write_key_part(out)
    }
}

impl<T: KeyPart + ToOwned + ?Sized> KeyPart for Cow<'_, T> {
    fn write_key_part(&self, out: &mut Vec<u8>) {
        self.as_ref().write_key_part(out)
    }
}
