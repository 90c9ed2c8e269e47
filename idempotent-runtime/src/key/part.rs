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

macro_rules! unsigned_key_part {
    ($($t:ty)*) => {$(
        impl KeyPart for $t {
            fn write_key_part(&self, out: &mut Vec<u8>) {
                super::push_decimal(out, u64::from(*self));
            }
        }
    )*};
}
unsigned_key_part!(u8 u16 u32 u64);

macro_rules! signed_key_part {
    ($($t:ty)*) => {$(
        impl KeyPart for $t {
            fn write_key_part(&self, out: &mut Vec<u8>) {
                if *self < 0 {
                    out.push(b'-');
                }
                super::push_decimal(out, u64::from(self.unsigned_abs()));
            }
        }
    )*};
}
signed_key_part!(i8 i16 i32 i64);

impl KeyPart for usize {
    fn write_key_part(&self, out: &mut Vec<u8>) {
        // No target has a `usize` wider than 64 bits.
        super::push_decimal(out, *self as u64);
    }
}

impl KeyPart for isize {
    fn write_key_part(&self, out: &mut Vec<u8>) {
        (*self as i64).write_key_part(out);
    }
}

macro_rules! wide_key_part {
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
wide_key_part!(u128 i128);

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

#[cfg(test)]
mod tests {
    use super::KeyPart;

    fn written(part: &dyn KeyPart) -> String {
        let mut out = Vec::new();
        part.write_key_part(&mut out);
        String::from_utf8(out).unwrap_or_default()
    }

    /// Every integer part is its decimal form, as `Display` writes it: keys built by earlier
    /// versions are found again.
    #[test]
    fn integers_are_written_as_display_writes_them() {
        let signed = [0i64, 1, -1, 9, -10, 12_345, i64::MIN, i64::MAX];
        for n in signed {
            assert_eq!(written(&n), n.to_string());
            assert_eq!(written(&(n as isize)), (n as isize).to_string());
            assert_eq!(written(&(n as i32)), (n as i32).to_string());
            assert_eq!(written(&(n as i16)), (n as i16).to_string());
            assert_eq!(written(&(n as i8)), (n as i8).to_string());
            assert_eq!(written(&i128::from(n)), n.to_string());
        }
        for n in [0u64, 1, 9, 10, 255, 65_535, u64::from(u32::MAX), u64::MAX] {
            assert_eq!(written(&n), n.to_string());
            assert_eq!(written(&(n as usize)), (n as usize).to_string());
            assert_eq!(written(&(n as u32)), (n as u32).to_string());
            assert_eq!(written(&(n as u16)), (n as u16).to_string());
            assert_eq!(written(&(n as u8)), (n as u8).to_string());
            assert_eq!(written(&u128::from(n)), n.to_string());
        }
        assert_eq!(written(&u128::MAX), u128::MAX.to_string());
        assert_eq!(written(&i128::MIN), i128::MIN.to_string());
    }
}
