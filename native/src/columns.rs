//! Avro records -> one ClickHouse Native block: the sink's insert of a batch without a Python object per value.
//!
//! The native twin of the Python row mapping for the tables whose columns are a record's fields by name
//! (sinks.rows.AVRO_TABLES): a column `x` is field `x`; a column `a.b` is field `b` of the records in array `a`
//! (a Nested column); Avro longs go into DateTime64(6) as microseconds. Native is the format chDB inserts fastest
//! (faster than ArrowStream, RowBinary or Avro for the same Transitions), and it is columnar, so each column is one
//! buffer filled as the records are read. Whatever it does not vouch for raises `Refused`: invalid UTF-8, bytes not
//! well-formed for the schema, trailing bytes, a wrong header, an integer out of its column's range. The sink then
//! takes that batch the Python way (decode, map, insert), which stays the reference (tests compare both).

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyList};
use serde_json::Value;
use std::collections::HashMap;
use std::sync::Mutex;

use crate::avro::{read_block_count, read_long, read_span, Refused, Reject, R};
use crate::schema::{full_name, null_first, UNSUPPORTED_UNION};

/// An Avro schema, compiled for reading (named types are copied where referenced: no recursive schemas).
#[derive(Clone)]
enum Avro {
    Null,
    Boolean,
    Int,
    Long,
    Float,
    Double,
    Str,
    Bytes,
    Enum(Vec<String>),
    Record(Vec<(String, Avro)>),
    Array(Box<Avro>),
    Map(Box<Avro>),
    Nullable { null_first: bool, inner: Box<Avro> },
}

/// A column's value type, as written into the block (LowCardinality is ClickHouse's storage, not the wire's).
#[derive(Clone, Copy, PartialEq)]
enum Scalar {
    Str,
    Int8,
    Int16,
    Int32,
    Int64,
    UInt8,
    UInt16,
    UInt32,
    UInt64,
    Float32,
    Float64,
    Bool,
}

struct Column {
    name: String,
    wire_type: String,
    array: bool,
    nullable: bool,
    scalar: Scalar,
    offsets: Vec<u8>,
    nulls: Vec<u8>,
    data: Vec<u8>,
    items: u64,
    lc: bool,
    dict: Dictionary, // a LowCardinality column's keys and indexes, filled as the records are read (not `data`)
    lc_body: Vec<u8>, // a LowCardinality column's data, made from `dict` once every record is read
}

/// What to do with one field of a record as it is read.
enum Step {
    Skip(Avro),
    /// Into column `col` (its element, when the column is an array: then `value` is the Avro array's items).
    Value {
        col: usize,
        value: Avro,
    },
    /// An array of records into Nested columns: per field of the item record, a column or a skip.
    Nested {
        fields: Vec<(Option<usize>, Avro)>,
        cols: Vec<usize>,
    },
}

struct Schemas {
    named: HashMap<String, Avro>,
}

impl Schemas {
    fn node(&mut self, schema: &Value, namespace: &str) -> Result<Avro, String> {
        match schema {
            Value::String(name) => self.named_or_primitive(name, namespace),
            Value::Array(branches) => {
                if let [first, second] = branches.as_slice() {
                    let (a, b) = (self.node(first, namespace)?, self.node(second, namespace)?);
                    match null_first(matches!(a, Avro::Null), matches!(b, Avro::Null)) {
                        Some(true) => {
                            return Ok(Avro::Nullable {
                                null_first: true,
                                inner: Box::new(b),
                            })
                        }
                        Some(false) => {
                            return Ok(Avro::Nullable {
                                null_first: false,
                                inner: Box::new(a),
                            })
                        }
                        None => {}
                    }
                }
                Err(UNSUPPORTED_UNION.into())
            }
            Value::Object(obj) => {
                let kind = match obj.get("type") {
                    Some(Value::String(kind)) => kind.as_str(),
                    Some(nested) => return self.node(nested, namespace),
                    None => return Err("a schema object without a type".into()),
                };
                if obj.contains_key("logicalType") {
                    return Err("logical types are not supported".into());
                }
                let name = obj.get("name").and_then(Value::as_str).unwrap_or("");
                let space = obj
                    .get("namespace")
                    .and_then(Value::as_str)
                    .unwrap_or(namespace);
                match kind {
                    "record" | "error" => {
                        let full = full_name(name, space);
                        let inner = full
                            .rsplit_once('.')
                            .map(|(ns, _)| ns.to_string())
                            .unwrap_or_default();
                        let mut fields = Vec::new();
                        for field in obj
                            .get("fields")
                            .and_then(Value::as_array)
                            .into_iter()
                            .flatten()
                        {
                            let fname = field.get("name").and_then(Value::as_str).unwrap_or("");
                            let node =
                                self.node(field.get("type").unwrap_or(&Value::Null), &inner)?;
                            fields.push((fname.to_string(), node));
                        }
                        let node = Avro::Record(fields);
                        self.named.insert(full, node.clone());
                        Ok(node)
                    }
                    "enum" => {
                        let symbols = obj
                            .get("symbols")
                            .and_then(Value::as_array)
                            .into_iter()
                            .flatten()
                            .filter_map(|s| s.as_str().map(str::to_string))
                            .collect();
                        let node = Avro::Enum(symbols);
                        self.named.insert(full_name(name, space), node.clone());
                        Ok(node)
                    }
                    "array" => Ok(Avro::Array(Box::new(
                        self.node(obj.get("items").unwrap_or(&Value::Null), namespace)?,
                    ))),
                    "map" => Ok(Avro::Map(Box::new(
                        self.node(obj.get("values").unwrap_or(&Value::Null), namespace)?,
                    ))),
                    "fixed" => Err("fixed is not supported".into()),
                    other => self.named_or_primitive(other, namespace),
                }
            }
            _ => Err("not an Avro schema".into()),
        }
    }

    fn named_or_primitive(&mut self, name: &str, namespace: &str) -> Result<Avro, String> {
        Ok(match name {
            "null" => Avro::Null,
            "boolean" => Avro::Boolean,
            "int" => Avro::Int,
            "long" => Avro::Long,
            "float" => Avro::Float,
            "double" => Avro::Double,
            "string" => Avro::Str,
            "bytes" => Avro::Bytes,
            _ => {
                let full = full_name(name, namespace);
                match self.named.get(&full).or_else(|| self.named.get(name)) {
                    Some(node) => node.clone(),
                    None => return Err(format!("unknown type {full}")),
                }
            }
        })
    }
}

/// `(array, nullable, scalar, wire type)` of a ClickHouse column type, or why it is not covered.
fn column_type(ch_type: &str) -> Result<(bool, bool, Scalar, String, bool), String> {
    fn unwrap<'a>(t: &'a str, wrapper: &str) -> Option<&'a str> {
        t.strip_prefix(wrapper)?
            .strip_prefix('(')?
            .strip_suffix(')')
    }
    fn plain(t: &str) -> &str {
        unwrap(t, "LowCardinality").unwrap_or(t)
    }
    let mut t = ch_type.trim();
    let mut lc = unwrap(t, "LowCardinality").is_some();
    t = plain(t);
    let array = match unwrap(t, "Array") {
        Some(inner) => {
            lc |= unwrap(inner, "LowCardinality").is_some();
            t = plain(inner);
            true
        }
        None => false,
    };
    let nullable = match unwrap(t, "Nullable") {
        Some(inner) => {
            t = plain(inner);
            true
        }
        None => false,
    };
    let scalar = match t {
        "String" => Scalar::Str,
        "Int8" => Scalar::Int8,
        "Int16" => Scalar::Int16,
        "Int32" => Scalar::Int32,
        "Int64" => Scalar::Int64,
        "UInt8" => Scalar::UInt8,
        "UInt16" => Scalar::UInt16,
        "UInt32" => Scalar::UInt32,
        "UInt64" => Scalar::UInt64,
        "Float32" => Scalar::Float32,
        "Float64" => Scalar::Float64,
        "Bool" => Scalar::Bool,
        _ if t.starts_with("DateTime64(6") => Scalar::Int64,
        _ => return Err(format!("column type {ch_type} is not covered")),
    };
    let lc = lc && scalar == Scalar::Str; // strings only: a LowCardinality number is sent as its plain type
    let mut wire = if nullable {
        format!("Nullable({t})")
    } else {
        t.to_string()
    };
    if lc {
        wire = format!("LowCardinality({wire})");
    }
    if array {
        wire = format!("Array({wire})");
    }
    Ok((array, nullable, scalar, wire, lc))
}

/// Whether an Avro value (not a union) can go into a column of this scalar type exactly as the Python row does.
fn fits(value: &Avro, scalar: Scalar) -> bool {
    use Scalar::*;
    match value {
        Avro::Str | Avro::Enum(_) | Avro::Bytes => scalar == Str,
        Avro::Int | Avro::Long => matches!(
            scalar,
            Int8 | Int16 | Int32 | Int64 | UInt8 | UInt16 | UInt32 | UInt64 | Float64
        ),
        Avro::Float => matches!(scalar, Float32 | Float64),
        Avro::Double => scalar == Float64,
        Avro::Boolean => matches!(scalar, Bool | UInt8),
        _ => false,
    }
}

/// A value fits a column (nullable on both sides, or not null on the Avro side).
fn fits_column(value: &Avro, nullable: bool, scalar: Scalar) -> bool {
    match value {
        Avro::Nullable { inner, .. } => nullable && fits(inner, scalar),
        other => fits(other, scalar),
    }
}

/// LowCardinality in a Native block, as ClickHouse writes it: a version (once per column, before an array's offsets),
/// then the dictionary of this block ("additional keys": the default string first, after a null placeholder when
/// nullable) and one index per value. Sending String for a LowCardinality column made ClickHouse build the dictionary
/// at insert, which cost it more than this does.
const LC_SHARED_DICTIONARIES_WITH_ADDITIONAL_KEYS: u64 = 1;
const LC_HAS_ADDITIONAL_KEYS: u64 = 1 << 9;
const LC_NEED_UPDATE_DICTIONARY: u64 = 1 << 10;

/// A fast hash for the dictionary's keys (FxHash's multiply-rotate over 8-byte words).
#[derive(Default)]
struct KeyHasher(u64);

impl std::hash::Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        const K: u64 = 0x517c_c1b7_2722_0a95;
        let mut h = self.0;
        let mut words = bytes.chunks_exact(8);
        for word in &mut words {
            h = (h.rotate_left(5) ^ u64::from_le_bytes(word.try_into().unwrap())).wrapping_mul(K);
        }
        let rest = words.remainder();
        let mut last = [0u8; 8];
        last[..rest.len()].copy_from_slice(rest);
        self.0 = (h.rotate_left(5) ^ u64::from_le_bytes(last) ^ bytes.len() as u64).wrapping_mul(K);
    }
}

/// A LowCardinality column's dictionary, made while the records are read: each value is looked up by its raw bytes
/// as it is read (no copy into `data` and no second pass), and only a value not seen before in this block is
/// checked for UTF-8 (a value equal to a checked key is valid too). Keys in order of first appearance, after the
/// default string (and the null placeholder before it, when nullable), as ClickHouse writes them.
#[derive(Default)]
struct Dictionary {
    known: HashMap<Box<[u8]>, u32, std::hash::BuildHasherDefault<KeyHasher>>,
    keys: Vec<u8>, // every key serialized (varuint length + bytes), in index order
    len: u32,
    default: u32, // the empty string's index
    indexes: Vec<u32>,
}

impl Dictionary {
    fn reset(&mut self, nullable: bool) {
        self.known.clear();
        self.keys.clear();
        self.indexes.clear();
        self.len = if nullable { 2 } else { 1 };
        self.default = self.len - 1;
        self.keys.extend_from_slice(&[0u8; 2][..self.len as usize]); // empty strings: varuint 0
    }

    #[inline]
    fn push_null(&mut self) {
        self.indexes.push(0);
    }

    /// A value's index; `utf8`: check a new key for UTF-8 (Avro strings), Refused when it is not.
    #[inline]
    fn push(&mut self, value: &[u8], utf8: bool) -> R<()> {
        let index = if value.is_empty() {
            self.default
        } else if let Some(&index) = self.known.get(value) {
            index
        } else {
            if utf8 && !self::utf8(value) {
                return Err(Reject);
            }
            let index = self.len;
            self.len += 1;
            write_varuint(&mut self.keys, value.len() as u64);
            self.keys.extend_from_slice(value);
            self.known.insert(value.into(), index);
            index
        };
        self.indexes.push(index);
        Ok(())
    }

    /// The LowCardinality body (empty when there are no values, as ClickHouse writes it).
    fn body(&self, out: &mut Vec<u8>) {
        out.clear();
        let count = self.indexes.len();
        if count == 0 {
            return;
        }
        let (index_type, width) = match self.len {
            0..=0x100 => (0u64, 1),
            0x101..=0x1_0000 => (1, 2),
            _ => (2, 4),
        };
        out.reserve(self.keys.len() + count * width + 32);
        out.extend_from_slice(
            &(index_type | LC_HAS_ADDITIONAL_KEYS | LC_NEED_UPDATE_DICTIONARY).to_le_bytes(),
        );
        out.extend_from_slice(&(self.len as u64).to_le_bytes());
        out.extend_from_slice(&self.keys);
        out.extend_from_slice(&(count as u64).to_le_bytes());
        match width {
            1 => out.extend(self.indexes.iter().map(|&i| i as u8)),
            2 => {
                for &i in &self.indexes {
                    out.extend_from_slice(&(i as u16).to_le_bytes());
                }
            }
            _ => {
                for &i in &self.indexes {
                    out.extend_from_slice(&i.to_le_bytes());
                }
            }
        }
    }
}

/// ClickHouse's VarUInt (LEB128): string lengths and the block's header.
#[inline]
fn write_varuint(out: &mut Vec<u8>, mut n: u64) {
    while n >= 0x80 {
        out.push((n as u8) | 0x80);
        n >>= 7;
    }
    out.push(n as u8);
}

#[inline]
fn read_fixed<const N: usize>(data: &[u8], pos: &mut usize) -> R<[u8; N]> {
    let raw: [u8; N] = data
        .get(*pos..*pos + N)
        .ok_or(Reject)?
        .try_into()
        .map_err(|_| Reject)?;
    *pos += N;
    Ok(raw)
}

/// Whether a union branch index says null.
#[inline]
fn is_null(data: &[u8], pos: &mut usize, null_first: bool) -> R<bool> {
    match (read_long(data, pos)?, null_first) {
        (0, true) | (1, false) => Ok(true),
        (1, true) | (0, false) => Ok(false),
        _ => Err(Reject),
    }
}

/// Reads a value and keeps nothing (still validated as the Python decoder would: UTF-8, enum range, booleans).
fn skip(node: &Avro, data: &[u8], pos: &mut usize) -> R<()> {
    match node {
        Avro::Null => {}
        Avro::Boolean => {
            if *data.get(*pos).ok_or(Reject)? > 1 {
                return Err(Reject);
            }
            *pos += 1;
        }
        Avro::Int | Avro::Long => {
            read_long(data, pos)?;
        }
        Avro::Float => {
            read_fixed::<4>(data, pos)?;
        }
        Avro::Double => {
            read_fixed::<8>(data, pos)?;
        }
        Avro::Str => {
            std::str::from_utf8(read_span(data, pos)?).map_err(|_| Reject)?;
        }
        Avro::Bytes => {
            read_span(data, pos)?;
        }
        Avro::Enum(symbols) => {
            let i = read_long(data, pos)?;
            if i < 0 || i as usize >= symbols.len() {
                return Err(Reject);
            }
        }
        Avro::Record(fields) => {
            for (_, field) in fields {
                skip(field, data, pos)?;
            }
        }
        Avro::Array(items) => loop {
            let n = read_block_count(data, pos)?;
            if n == 0 {
                break;
            }
            for _ in 0..n {
                skip(items, data, pos)?;
            }
        },
        Avro::Map(values) => loop {
            let n = read_block_count(data, pos)?;
            if n == 0 {
                break;
            }
            for _ in 0..n {
                std::str::from_utf8(read_span(data, pos)?).map_err(|_| Reject)?;
                skip(values, data, pos)?;
            }
        },
        Avro::Nullable { null_first, inner } => {
            if !is_null(data, pos, *null_first)? {
                skip(inner, data, pos)?;
            }
        }
    }
    Ok(())
}

#[inline]
fn put_int(out: &mut Vec<u8>, scalar: Scalar, v: i64) -> R<()> {
    fn narrow<T: TryFrom<i64>>(v: i64) -> R<T> {
        T::try_from(v).map_err(|_| Reject)
    }
    match scalar {
        Scalar::Int8 => out.extend_from_slice(&narrow::<i8>(v)?.to_le_bytes()),
        Scalar::Int16 => out.extend_from_slice(&narrow::<i16>(v)?.to_le_bytes()),
        Scalar::Int32 => out.extend_from_slice(&narrow::<i32>(v)?.to_le_bytes()),
        Scalar::Int64 => out.extend_from_slice(&v.to_le_bytes()),
        Scalar::UInt8 => out.extend_from_slice(&narrow::<u8>(v)?.to_le_bytes()),
        Scalar::UInt16 => out.extend_from_slice(&narrow::<u16>(v)?.to_le_bytes()),
        Scalar::UInt32 => out.extend_from_slice(&narrow::<u32>(v)?.to_le_bytes()),
        Scalar::UInt64 => out.extend_from_slice(&narrow::<u64>(v)?.to_le_bytes()),
        Scalar::Float64 => {
            if v.unsigned_abs() > (1u64 << 53) {
                return Err(Reject); // float(int) rounds here: leave it to Python
            }
            out.extend_from_slice(&(v as f64).to_le_bytes())
        }
        _ => return Err(Reject),
    }
    Ok(())
}

/// The zero value of a scalar (what a Nullable column holds under a null).
fn put_default(out: &mut Vec<u8>, scalar: Scalar) {
    let width = match scalar {
        Scalar::Str => 1, // a varuint 0: the empty string
        Scalar::Int8 | Scalar::UInt8 | Scalar::Bool => 1,
        Scalar::Int16 | Scalar::UInt16 => 2,
        Scalar::Int32 | Scalar::UInt32 | Scalar::Float32 => 4,
        Scalar::Int64 | Scalar::UInt64 | Scalar::Float64 => 8,
    };
    out.extend_from_slice(&[0u8; 8][..width]);
}

/// Whether `raw` is UTF-8, as str::from_utf8 says; ASCII (nearly every id and name) checked inline first.
#[inline(always)]
fn utf8(raw: &[u8]) -> bool {
    raw.is_ascii() || std::str::from_utf8(raw).is_ok()
}

/// An enum value's symbol (its index read as a long); Refused when the index is out of range.
#[inline(always)]
fn read_symbol<'a>(symbols: &'a [String], data: &[u8], pos: &mut usize) -> R<&'a str> {
    let i = read_long(data, pos)?;
    symbols
        .get(usize::try_from(i).map_err(|_| Reject)?)
        .map(String::as_str)
        .ok_or(Reject)
}

/// Reads one non-union value into a column's data.
#[inline(always)]
fn put(node: &Avro, scalar: Scalar, data: &[u8], pos: &mut usize, out: &mut Vec<u8>) -> R<()> {
    match node {
        Avro::Str | Avro::Bytes => {
            let raw = read_span(data, pos)?;
            if matches!(node, Avro::Str) && !utf8(raw) {
                return Err(Reject);
            }
            write_varuint(out, raw.len() as u64);
            out.extend_from_slice(raw);
        }
        Avro::Enum(symbols) => {
            let symbol = read_symbol(symbols, data, pos)?;
            write_varuint(out, symbol.len() as u64);
            out.extend_from_slice(symbol.as_bytes());
        }
        Avro::Int | Avro::Long => {
            let v = read_long(data, pos)?;
            if matches!(node, Avro::Int) && i32::try_from(v).is_err() {
                return Err(Reject);
            }
            put_int(out, scalar, v)?;
        }
        Avro::Float => {
            let f = f32::from_le_bytes(read_fixed::<4>(data, pos)?);
            match scalar {
                Scalar::Float32 => out.extend_from_slice(&f.to_le_bytes()),
                _ => out.extend_from_slice(&(f as f64).to_le_bytes()),
            }
        }
        Avro::Double => out.extend_from_slice(&read_fixed::<8>(data, pos)?),
        Avro::Boolean => {
            let b = *data.get(*pos).ok_or(Reject)?;
            if b > 1 {
                return Err(Reject);
            }
            *pos += 1;
            out.push(b);
        }
        _ => return Err(Reject),
    }
    Ok(())
}

/// Reads one value (a union or not) into a column (its element, for an array column).
#[inline(always)]
fn put_value(col: &mut Column, node: &Avro, data: &[u8], pos: &mut usize) -> R<()> {
    if col.lc {
        return put_key(&mut col.dict, node, data, pos);
    }
    match node {
        Avro::Nullable { null_first, inner } => {
            if is_null(data, pos, *null_first)? {
                col.nulls.push(1);
                put_default(&mut col.data, col.scalar);
                Ok(())
            } else {
                col.nulls.push(0);
                put(inner, col.scalar, data, pos, &mut col.data)
            }
        }
        other => {
            if col.nullable {
                col.nulls.push(0);
            }
            put(other, col.scalar, data, pos, &mut col.data)
        }
    }
}

/// Reads one string value (a union or not) into a LowCardinality column's dictionary.
fn put_key(dict: &mut Dictionary, node: &Avro, data: &[u8], pos: &mut usize) -> R<()> {
    let node = match node {
        Avro::Nullable { null_first, inner } => {
            if is_null(data, pos, *null_first)? {
                dict.push_null();
                return Ok(());
            }
            inner.as_ref()
        }
        other => other,
    };
    match node {
        Avro::Str => dict.push(read_span(data, pos)?, true),
        Avro::Bytes => dict.push(read_span(data, pos)?, false),
        Avro::Enum(symbols) => dict.push(read_symbol(symbols, data, pos)?.as_bytes(), false),
        _ => Err(Reject),
    }
}

/// One table's transcoder: the single-object-encoded records of one writer schema -> a Native block of the columns.
#[pyclass(frozen, module = "treadle_native")]
pub struct NativeBlockWriter {
    prefix: Vec<u8>,
    steps: Vec<Step>,
    columns: Vec<(String, String, bool, bool, Scalar, bool)>, // name, wire type, array, nullable, scalar, lc
    /// The last block's column buffers, cleared and filled again by the next one: fresh multi-megabyte buffers per
    /// block cost more in page faults than reading the records does.
    spare: Mutex<Option<Vec<Column>>>,
    /// The last block handed out, written over by the next one once nothing else holds it (its caller has dropped
    /// it): a fresh multi-megabyte `bytes` per block cost the insert after it more than the copy into it.
    out: Mutex<Option<Py<PyByteArray>>>,
}

impl NativeBlockWriter {
    /// Every record read into the columns' buffers.
    fn columns_of(&self, records: &[&[u8]], spare: Option<Vec<Column>>) -> R<Vec<Column>> {
        let rows = records.len();
        let total: usize = records.iter().map(|r| r.len()).sum();
        let mut cols: Vec<Column> = match spare {
            Some(mut cols) => {
                for col in &mut cols {
                    col.offsets.clear();
                    col.nulls.clear();
                    col.data.clear();
                    col.items = 0;
                    if col.lc {
                        col.dict.reset(col.nullable);
                    }
                }
                cols
            }
            None => self.fresh_columns(rows, total),
        };
        for record in records {
            self.record(&mut cols, record)?;
        }
        for col in cols.iter_mut().filter(|c| c.lc) {
            col.dict.body(&mut col.lc_body);
        }
        Ok(cols)
    }

    fn fresh_columns(&self, rows: usize, total: usize) -> Vec<Column> {
        self.columns
            .iter()
            .map(|(name, wire, array, nullable, scalar, lc)| Column {
                name: name.clone(),
                wire_type: wire.clone(),
                array: *array,
                nullable: *nullable,
                scalar: *scalar,
                offsets: Vec::with_capacity(if *array { rows * 8 } else { 0 }),
                nulls: Vec::with_capacity(if *nullable { rows } else { 0 }),
                data: Vec::with_capacity(if *lc {
                    0
                } else if *scalar == Scalar::Str {
                    total / 16
                } else {
                    rows * 8
                }),
                items: 0,
                lc: *lc,
                dict: {
                    let mut dict = Dictionary::default();
                    dict.reset(*nullable);
                    dict
                },
                lc_body: Vec::new(),
            })
            .collect()
    }

    fn record(&self, cols: &mut [Column], data: &[u8]) -> R<()> {
        if !data.starts_with(&self.prefix) {
            return Err(Reject);
        }
        let mut pos = self.prefix.len();
        let pos = &mut pos;
        for step in &self.steps {
            match step {
                Step::Skip(node) => skip(node, data, pos)?,
                Step::Value { col, value } => {
                    let col = &mut cols[*col];
                    if col.array {
                        let Avro::Array(items) = value else {
                            return Err(Reject);
                        };
                        loop {
                            let n = read_block_count(data, pos)?;
                            if n == 0 {
                                break;
                            }
                            for _ in 0..n {
                                put_value(col, items, data, pos)?;
                                col.items += 1;
                            }
                        }
                        col.offsets.extend_from_slice(&col.items.to_le_bytes());
                    } else {
                        put_value(col, value, data, pos)?;
                    }
                }
                Step::Nested { fields, cols: used } => {
                    loop {
                        let n = read_block_count(data, pos)?;
                        if n == 0 {
                            break;
                        }
                        for _ in 0..n {
                            for (target, node) in fields {
                                match target {
                                    Some(c) => put_value(&mut cols[*c], node, data, pos)?,
                                    None => skip(node, data, pos)?,
                                }
                            }
                            for c in used {
                                cols[*c].items += 1;
                            }
                        }
                    }
                    for c in used {
                        let col = &mut cols[*c];
                        col.offsets.extend_from_slice(&col.items.to_le_bytes());
                    }
                }
            }
        }
        if *pos != data.len() {
            return Err(Reject);
        }
        Ok(())
    }
}

#[pymethods]
impl NativeBlockWriter {
    /// `schema_json`: the writer schema (a record); `columns`: [(column name, ClickHouse type)] in insert order;
    /// `prefix`: the single-object header every value starts with. ValueError for a table it does not cover: a
    /// column no field feeds, a field whose type its column does not take exactly, a type it does not write.
    #[new]
    fn new(schema_json: &str, columns: Vec<(String, String)>, prefix: Vec<u8>) -> PyResult<Self> {
        let schema: Value = serde_json::from_str(schema_json)
            .map_err(|e| PyValueError::new_err(format!("bad schema JSON: {e}")))?;
        let mut schemas = Schemas {
            named: HashMap::new(),
        };
        let Avro::Record(fields) = schemas.node(&schema, "").map_err(PyValueError::new_err)? else {
            return Err(PyValueError::new_err("the schema is not a record"));
        };
        let mut typed = Vec::new();
        let mut by_name: HashMap<&str, usize> = HashMap::new();
        for (i, (name, ch_type)) in columns.iter().enumerate() {
            let (array, nullable, scalar, wire, lc) =
                column_type(ch_type).map_err(PyValueError::new_err)?;
            typed.push((name.clone(), wire, array, nullable, scalar, lc));
            by_name.insert(name.as_str(), i);
        }
        let mut fed = vec![false; columns.len()];
        let mut steps = Vec::new();
        for (fname, node) in &fields {
            if let Some(&col) = by_name.get(fname.as_str()) {
                let (_, _, array, nullable, scalar, _) = &typed[col];
                let ok = match (node, array) {
                    (Avro::Array(items), true) => fits_column(items, *nullable, *scalar),
                    (_, false) => fits_column(node, *nullable, *scalar),
                    _ => false,
                };
                if !ok {
                    return Err(PyValueError::new_err(format!(
                        "field {fname} does not fit column type {}",
                        columns[col].1
                    )));
                }
                fed[col] = true;
                steps.push(Step::Value {
                    col,
                    value: node.clone(),
                });
                continue;
            }
            let prefix = format!("{fname}.");
            let nested: Vec<usize> = (0..columns.len())
                .filter(|&c| columns[c].0.starts_with(&prefix))
                .collect();
            if nested.is_empty() {
                steps.push(Step::Skip(node.clone()));
                continue;
            }
            let Avro::Array(items) = node else {
                return Err(PyValueError::new_err(format!(
                    "field {fname} feeds Nested columns but is not an array"
                )));
            };
            let Avro::Record(item_fields) = items.as_ref() else {
                return Err(PyValueError::new_err(format!(
                    "field {fname} feeds Nested columns but holds no records"
                )));
            };
            let mut plan = Vec::new();
            for (sub, sub_node) in item_fields {
                let target = by_name.get(format!("{fname}.{sub}").as_str()).copied();
                if let Some(col) = target {
                    let (_, _, array, nullable, scalar, _) = &typed[col];
                    if !*array || !fits_column(sub_node, *nullable, *scalar) {
                        return Err(PyValueError::new_err(format!(
                            "field {fname}.{sub} does not fit its column"
                        )));
                    }
                    fed[col] = true;
                }
                plan.push((target, sub_node.clone()));
            }
            steps.push(Step::Nested {
                fields: plan,
                cols: nested,
            });
        }
        if let Some(c) = fed.iter().position(|f| !f) {
            return Err(PyValueError::new_err(format!(
                "no field feeds column {}",
                columns[c].0
            )));
        }
        Ok(NativeBlockWriter {
            prefix,
            steps,
            columns: typed,
            spare: Mutex::new(None),
            out: Mutex::new(None),
        })
    }

    /// One Native block (FORMAT Native) of every value in `values` (a list of bytes), in order, as a bytearray: the
    /// previous call's, written over, when its caller no longer holds it (a block still referenced is never changed).
    /// Refused when a value is not a well-formed record of the schema or does not fit its column (the caller takes
    /// the Python way).
    fn block<'py>(
        &self,
        py: Python<'py>,
        values: &Bound<'py, PyList>,
    ) -> PyResult<Bound<'py, PyByteArray>> {
        let rows = values.len();
        let mut records = Vec::with_capacity(rows);
        for value in values.iter() {
            let bytes = value
                .downcast_into::<PyBytes>()
                .map_err(|_| Refused::new_err("a value is not bytes"))?;
            records.push(bytes);
        }
        let slices: Vec<&[u8]> = records.iter().map(|b| b.as_bytes()).collect();
        // The records are read without the GIL: a sink that calls this on its ClickHouse thread leaves the
        // interpreter to its event loop meanwhile.
        // Never waits: busy only while another thread makes a block with this writer; then this one's are fresh.
        let spare = self.spare.try_lock().ok().and_then(|mut held| held.take());
        let cols = py
            .allow_threads(|| self.columns_of(&slices, spare))
            .map_err(|_| {
                Refused::new_err(
                    "a record is not well-formed for the schema or does not fit its columns",
                )
            })?;
        let mut head = Vec::with_capacity(20);
        write_varuint(&mut head, cols.len() as u64);
        write_varuint(&mut head, rows as u64);
        let mut parts: Vec<&[u8]> = vec![&head];
        let mut names = Vec::with_capacity(cols.len());
        for col in &cols {
            let mut name = Vec::with_capacity(col.name.len() + col.wire_type.len() + 4);
            write_varuint(&mut name, col.name.len() as u64);
            name.extend_from_slice(col.name.as_bytes());
            write_varuint(&mut name, col.wire_type.len() as u64);
            name.extend_from_slice(col.wire_type.as_bytes());
            names.push(name);
        }
        let version = LC_SHARED_DICTIONARIES_WITH_ADDITIONAL_KEYS.to_le_bytes();
        for (col, name) in cols.iter().zip(&names) {
            if col.lc {
                parts.extend([name.as_slice(), &version, &col.offsets, &col.lc_body]);
            } else {
                parts.extend([name.as_slice(), &col.offsets, &col.nulls, &col.data]);
            }
        }
        let size = parts.iter().map(|p| p.len()).sum();
        let mut held = self.out.try_lock().ok();
        let reusable = held
            .as_mut()
            .and_then(|held| held.take())
            .map(|out| out.into_bound(py))
            .filter(|out| out.get_refcnt() == 1); // only this writer holds it: nobody can see it change
        let block = match reusable {
            Some(out) => {
                out.resize(size)?;
                out
            }
            None => PyByteArray::new_with(py, size, |_| Ok(()))?,
        };
        // SAFETY: the bytearray is this writer's alone (new, or held by nothing else), the GIL is held, and
        // nothing runs Python code while its bytes are borrowed here.
        let buf = unsafe { block.as_bytes_mut() };
        let mut at = 0;
        for part in &parts {
            buf[at..at + part.len()].copy_from_slice(part);
            at += part.len();
        }
        drop(parts);
        if let Some(held) = held.as_mut() {
            **held = Some(block.clone().unbind());
        }
        drop(held);
        if let Ok(mut held) = self.spare.try_lock() {
            *held = Some(cols);
        }
        Ok(block)
    }
}
