//! Store addresses as error messages and logs may show them.

/// The URL with any password replaced, for error messages.
pub(crate) fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(start), Some(at)) if at > start => {
            let userinfo = &url[start + 3..at];
            match userinfo.find(':') {
                Some(colon) => format!(
                    "{}{}:***{}",
                    &url[..start + 3],
                    &userinfo[..colon],
                    &url[at..]
                ),
                None => url.to_string(),
            }
        }
        _ => url.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(
            redact("redis://user:secret@host:6379"),
            "redis://user:***@host:6379"
        );
        assert_eq!(redact("redis://host:6379"), "redis://host:6379");
        assert_eq!(redact("postgres://u@h/db"), "postgres://u@h/db");
    }
}
