//! The configurable table name: validated against a strict identifier whitelist (it is
//! written into SQL text, so nothing else may get through), and the names derived from it.

use sha2::{Digest, Sha256};

use crate::error::{StoreError, StoreErrorKind};

/// The longest identifier every supported database accepts unchanged (PostgreSQL truncates
/// at 63 bytes, MySQL refuses more than 64).
const MAX_IDENT: usize = 63;

/// A validated table name, optionally schema-qualified (PostgreSQL only).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TableName {
    /// `schema.table` or `table`, as written into SQL.
    qualified: String,
    /// The schema, when qualified.
    schema: Option<String>,
    /// The table without its schema.
    table: String,
}

impl TableName {
    /// Validates `name`: `[A-Za-z_][A-Za-z0-9_]{0,62}`, or two such identifiers joined by a
    /// dot when `schema_qualified` is allowed.
    pub(crate) fn parse(
        name: &str,
        schema_qualified: bool,
        database: &str,
    ) -> Result<TableName, StoreError> {
        let (schema, table) = match name.split_once('.') {
            Some((schema, table)) if schema_qualified => (Some(schema), table),
            _ => (None, name),
        };
        let valid = schema.is_none_or(is_identifier) && is_identifier(table);
        if !valid {
            let expected = if schema_qualified {
                "`[A-Za-z_][A-Za-z0-9_]{0,62}`, optionally as `schema.table`"
            } else {
                "`[A-Za-z_][A-Za-z0-9_]{0,62}`"
            };
            return Err(StoreError::new(
                StoreErrorKind::Unsafe,
                format!("invalid {database} table name {name:?}: expected {expected}"),
            ));
        }
        Ok(TableName {
            qualified: name.to_string(),
            schema: schema.map(str::to_string),
            table: table.to_string(),
        })
    }

    /// The name as written into SQL.
    pub(crate) fn as_str(&self) -> &str {
        &self.qualified
    }

    /// The schema, when the name is qualified.
    pub(crate) fn schema(&self) -> Option<&str> {
        self.schema.as_deref()
    }

    /// The name of the table that tracks this table's migrations, next to it.
    pub(crate) fn migrations_table(&self) -> String {
        match &self.schema {
            Some(schema) => format!("{schema}.{}", derived(&self.table, "_migrations")),
            None => derived(&self.table, "_migrations"),
        }
    }

    /// The table's name followed by `suffix`, shortened with a hash to fit an identifier
    /// (unqualified: for indexes, which live in their table's schema).
    pub(crate) fn with_suffix(&self, suffix: &str) -> String {
        derived(&self.table, suffix)
    }

    /// `template` with the identifier `base` replaced by this table's name, and each
    /// `base + suffix` by [`with_suffix`](TableName::with_suffix)`(suffix)`. Only whole
    /// identifiers are replaced.
    pub(crate) fn render_for(&self, template: &str, base: &str, suffixes: &[&str]) -> String {
        let mut out = String::with_capacity(template.len() + 64);
        let mut rest = template;
        while let Some(start) = rest.find(|c: char| c.is_ascii_alphabetic() || c == '_') {
            out.push_str(&rest[..start]);
            let word_len = rest[start..]
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(rest.len() - start);
            let word = &rest[start..start + word_len];
            match word.strip_prefix(base) {
                Some("") => out.push_str(self.as_str()),
                Some(suffix) if suffixes.contains(&suffix) => {
                    out.push_str(&self.with_suffix(suffix));
                }
                _ => out.push_str(word),
            }
            rest = &rest[start + word_len..];
        }
        out.push_str(rest);
        out
    }
}

fn is_identifier(s: &str) -> bool {
    let mut chars = s.chars();
    let first_ok = chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
    first_ok && s.len() <= MAX_IDENT && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// `table + suffix`, or, when that is too long for an identifier, a readable start of the
/// table's name and a digest of the whole, so distinct tables never share derived names.
fn derived(table: &str, suffix: &str) -> String {
    let name = format!("{table}{suffix}");
    if name.len() <= MAX_IDENT {
        return name;
    }
    let digest = Sha256::digest(table.as_bytes());
    let hex = crate::key::hex_string(&digest[..8]);
    let keep = MAX_IDENT - suffix.len() - hex.len() - 1;
    format!("{}_{hex}{suffix}", &table[..keep])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_are_whitelisted() {
        for ok in ["t", "_t", "idempotent_records", "T1_x", &"a".repeat(63)] {
            assert!(TableName::parse(ok, false, "db").is_ok(), "{ok}");
        }
        for bad in [
            "",
            "1t",
            "t-x",
            "t x",
            "t;drop table x",
            "t\"",
            "`t`",
            "t.x",
            "é",
            &"a".repeat(64),
        ] {
            let err = TableName::parse(bad, false, "db").unwrap_err();
            assert_eq!(err.kind(), StoreErrorKind::Unsafe, "{bad}");
        }
    }

    #[test]
    fn postgres_names_may_carry_a_schema() {
        let name = TableName::parse("idem.records", true, "PostgreSQL").unwrap();
        assert_eq!(name.as_str(), "idem.records");
        assert_eq!(name.schema(), Some("idem"));
        assert_eq!(name.migrations_table(), "idem.records_migrations");
        assert_eq!(name.with_suffix("_expires_at"), "records_expires_at");
        for bad in ["a.b.c", ".b", "a.", "a..b", "a.1b"] {
            assert!(TableName::parse(bad, true, "PostgreSQL").is_err(), "{bad}");
        }
    }

    #[test]
    fn derived_names_fit_an_identifier_and_stay_distinct() {
        let a = TableName::parse(&"a".repeat(63), false, "db").unwrap();
        let b = TableName::parse(&format!("{}b", "a".repeat(62)), false, "db").unwrap();
        for name in [
            a.migrations_table(),
            a.with_suffix("_expires_at"),
            b.migrations_table(),
        ] {
            assert!(name.len() <= MAX_IDENT, "{name}");
            assert!(is_identifier(&name), "{name}");
        }
        assert_ne!(a.migrations_table(), b.migrations_table());
        assert_ne!(a.with_suffix("_expires_at"), b.with_suffix("_expires_at"));
    }

    #[test]
    fn render_replaces_whole_identifiers_only() {
        let name = TableName::parse("s.orders", true, "PostgreSQL").unwrap();
        let sql = "CREATE TABLE idempotent_records (x idempotent_records_x);\n\
                   CREATE INDEX idempotent_records_expires_at ON idempotent_records (expires_at);";
        assert_eq!(
            name.render_for(sql, "idempotent_records", &["_expires_at"]),
            "CREATE TABLE s.orders (x idempotent_records_x);\n\
             CREATE INDEX orders_expires_at ON s.orders (expires_at);"
        );
    }
}
