//! What the record codec (`avro`) and the Native block writer (`columns`) read the same way in a schema's JSON.
//! Each compiles its own tree (the codec keeps named records in tables, for Python's interned field names; the
//! block writer copies them inline, to walk columns), from these shared rules.

/// A named type's full name: `name` as is when it has a dot (already full) or there is no namespace.
pub(crate) fn full_name(name: &str, namespace: &str) -> String {
    if name.contains('.') || namespace.is_empty() {
        name.to_string()
    } else {
        format!("{namespace}.{name}")
    }
}

/// The one union both accept: null and one other type, in either order. Given whether each of the two branches
/// is null, whether null comes first (its branch index is 0); None for any other union.
pub(crate) fn null_first(first_is_null: bool, second_is_null: bool) -> Option<bool> {
    match (first_is_null, second_is_null) {
        (true, false) => Some(true),
        (false, true) => Some(false),
        _ => None,
    }
}

pub(crate) const UNSUPPORTED_UNION: &str = "only unions of null and one other type are supported";
