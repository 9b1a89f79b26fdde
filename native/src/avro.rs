//! An Avro record codec compiled once per schema: the native twin of topics/avro_writer.py and avro_reader.py.
//!
//! Same contract as the generated Python: it writes only plain, exactly typed values (dict, list, str, int within
//! range, float, bytes, bool, None for a nullable union) and reads only well-formed bytes of a writer schema read
//! as itself; anything else raises `Refused`, and topics/codec.py hands the record or bytes to fastavro, whose
//! leniency and error messages stay the reference. Where it writes or reads, the result is fastavro's, byte for
//! byte and value for value (tests/test_avro_native.py). About 4x faster than the generated Python per record.
//! A record may also be given as a tuple of its field values in schema order (AvroCodec.writer, for the SDK's hot
//! paths, which then build no dicts); topics/codec.py turns such tuples into dicts for the other writers.

use std::collections::HashMap;
use std::sync::{Mutex, TryLockError};

use pyo3::create_exception;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use serde_json::Value;

use crate::schema::{full_name, null_first, UNSUPPORTED_UNION};

create_exception!(
    treadle_native,
    Refused,
    PyValueError,
    "A value or bytes the native codec does not vouch for: fastavro writes or reads them (or names the error)."
);

/// A schema, compiled: what to write or read at each place. Named records and enums live in the codec's tables, so
/// a type referenced by name (or recursively) is one index.
#[derive(Clone)]
enum Node {
    Null,
    Boolean,
    Int,
    Long,
    Float,
    Double,
    Str,
    Bytes,
    Record(usize),
    Enum(usize),
    Array(Box<Node>),
    Map(Box<Node>),
    Nullable { null_first: bool, inner: Box<Node> },
}

struct Record {
    fields: Vec<(Py<PyString>, Node)>,
}

struct EnumDef {
    symbols: Vec<Py<PyString>>,
    index: HashMap<String, usize>,
}

/// Slots of a codec's cache of decoded strings (a power of two), and the longest string it keeps.
const RECENT_STRINGS: usize = 4096;
const RECENT_STRING_MAX: usize = 64;

/// Strings this codec decoded lately, one per slot, by a hash of their bytes. Events repeat most of their strings
/// (session, episode, agent, logical_event_id, policy version, reward source and name, attribute keys): a string
/// still in its slot is handed out again, the same object, so a batch of records allocates, keeps and frees a
/// fraction of the strings it would. A new string takes over its slot; unique ones (event ids) just pass through.
struct RecentStrings {
    slots: Vec<Option<(u64, Py<PyString>)>>, // (hash of its bytes, the string)
}

impl RecentStrings {
    fn new() -> Self {
        RecentStrings {
            slots: (0..RECENT_STRINGS).map(|_| None).collect(),
        }
    }

    /// No slots: every string is a new object.
    fn none() -> Self {
        RecentStrings { slots: Vec::new() }
    }

    fn get<'py>(&mut self, py: Python<'py>, s: &str) -> Bound<'py, PyString> {
        if s.len() > RECENT_STRING_MAX || self.slots.is_empty() {
            return PyString::new(py, s);
        }
        let hash = hash_of(s.as_bytes());
        let slot = &mut self.slots[(hash >> (64 - RECENT_STRINGS.trailing_zeros())) as usize];
        if let Some((known_hash, known)) = slot {
            // The hash first: the slots are hot, a string that left the cache long ago is not.
            if *known_hash == hash {
                let known = known.bind(py);
                if known.to_str().is_ok_and(|k| k == s) {
                    return known.clone();
                }
            }
        }
        let fresh = PyString::new(py, s);
        *slot = Some((hash, fresh.clone().unbind()));
        fresh
    }
}

/// A multiply-rotate hash over 8-byte words (its top bits pick the slot).
#[inline]
fn hash_of(bytes: &[u8]) -> u64 {
    const K: u64 = 0x517c_c1b7_2722_0a95;
    let mut h = bytes.len() as u64;
    let mut words = bytes.chunks_exact(8);
    for word in &mut words {
        h = (h.rotate_left(5) ^ u64::from_le_bytes(word.try_into().unwrap())).wrapping_mul(K);
    }
    let rest = words.remainder();
    if !rest.is_empty() {
        let mut last = [0u8; 8];
        last[..rest.len()].copy_from_slice(rest);
        h = (h.rotate_left(5) ^ u64::from_le_bytes(last)).wrapping_mul(K);
    }
    h
}

/// A value or bytes not ours to write or read (raised to Python as `Refused`).
pub(crate) struct Reject;

pub(crate) type R<T> = Result<T, Reject>;

/// One schema's writer and reader; `prefix` (the single-object header) starts every encoded record.
#[pyclass(frozen, module = "treadle_native")]
pub struct RecordCodec {
    root: Node,
    records: Vec<Record>,
    enums: Vec<EnumDef>,
    prefix: Vec<u8>,
    recent: Mutex<RecentStrings>,
}

/// Turns schema JSON into Nodes, keeping named types as it meets their definitions (Avro defines a name before use).
struct Compiler<'py> {
    py: Python<'py>,
    records: Vec<Record>,
    enums: Vec<EnumDef>,
    named: HashMap<String, Node>,
}

impl<'py> Compiler<'py> {
    fn node(&mut self, schema: &Value, namespace: &str) -> PyResult<Node> {
        match schema {
            Value::String(name) => self.named_or_primitive(name, namespace),
            Value::Array(branches) => self.union(branches, namespace),
            Value::Object(obj) => {
                let kind = match obj.get("type") {
                    Some(Value::String(kind)) => kind.as_str(),
                    Some(nested) => return self.node(nested, namespace),
                    None => return Err(PyValueError::new_err("a schema object without a type")),
                };
                if obj.contains_key("logicalType") {
                    return Err(PyValueError::new_err("logical types are not supported"));
                }
                match kind {
                    "record" | "error" => {
                        let name = obj.get("name").and_then(Value::as_str).unwrap_or("");
                        let space = obj
                            .get("namespace")
                            .and_then(Value::as_str)
                            .unwrap_or(namespace);
                        let full = full_name(name, space);
                        let inner_space = full
                            .rsplit_once('.')
                            .map(|(ns, _)| ns.to_string())
                            .unwrap_or_default();
                        let id = self.records.len();
                        self.records.push(Record { fields: Vec::new() });
                        self.named.insert(full, Node::Record(id));
                        let mut fields = Vec::new();
                        for field in obj
                            .get("fields")
                            .and_then(Value::as_array)
                            .into_iter()
                            .flatten()
                        {
                            let fname = field.get("name").and_then(Value::as_str).unwrap_or("");
                            let ftype = field.get("type").unwrap_or(&Value::Null);
                            let node = self.node(ftype, &inner_space)?;
                            fields.push((PyString::intern(self.py, fname).unbind(), node));
                        }
                        self.records[id].fields = fields;
                        Ok(Node::Record(id))
                    }
                    "enum" => {
                        let name = obj.get("name").and_then(Value::as_str).unwrap_or("");
                        let space = obj
                            .get("namespace")
                            .and_then(Value::as_str)
                            .unwrap_or(namespace);
                        let symbols: Vec<String> = obj
                            .get("symbols")
                            .and_then(Value::as_array)
                            .into_iter()
                            .flatten()
                            .filter_map(|s| s.as_str().map(str::to_string))
                            .collect();
                        let id = self.enums.len();
                        self.enums.push(EnumDef {
                            symbols: symbols
                                .iter()
                                .map(|s| PyString::intern(self.py, s).unbind())
                                .collect(),
                            index: symbols
                                .iter()
                                .enumerate()
                                .map(|(i, s)| (s.clone(), i))
                                .collect(),
                        });
                        self.named.insert(full_name(name, space), Node::Enum(id));
                        Ok(Node::Enum(id))
                    }
                    "array" => Ok(Node::Array(Box::new(
                        self.node(obj.get("items").unwrap_or(&Value::Null), namespace)?,
                    ))),
                    "map" => Ok(Node::Map(Box::new(
                        self.node(obj.get("values").unwrap_or(&Value::Null), namespace)?,
                    ))),
                    "fixed" => Err(PyValueError::new_err("fixed is not supported")),
                    other => self.named_or_primitive(other, namespace),
                }
            }
            _ => Err(PyValueError::new_err("not an Avro schema")),
        }
    }

    fn named_or_primitive(&mut self, name: &str, namespace: &str) -> PyResult<Node> {
        Ok(match name {
            "null" => Node::Null,
            "boolean" => Node::Boolean,
            "int" => Node::Int,
            "long" => Node::Long,
            "float" => Node::Float,
            "double" => Node::Double,
            "string" => Node::Str,
            "bytes" => Node::Bytes,
            _ => {
                let full = full_name(name, namespace);
                match self.named.get(&full).or_else(|| self.named.get(name)) {
                    Some(node) => node.clone(),
                    None => return Err(PyValueError::new_err(format!("unknown type {full}"))),
                }
            }
        })
    }

    fn union(&mut self, branches: &[Value], namespace: &str) -> PyResult<Node> {
        if let [first, second] = branches {
            let (a, b) = (self.node(first, namespace)?, self.node(second, namespace)?);
            match null_first(matches!(a, Node::Null), matches!(b, Node::Null)) {
                Some(true) => {
                    return Ok(Node::Nullable {
                        null_first: true,
                        inner: Box::new(b),
                    })
                }
                Some(false) => {
                    return Ok(Node::Nullable {
                        null_first: false,
                        inner: Box::new(a),
                    })
                }
                None => {}
            }
        }
        Err(PyValueError::new_err(UNSUPPORTED_UNION))
    }
}

// --- writing ----------------------------------------------------------------------------------------------------

#[inline]
fn write_long(out: &mut Vec<u8>, value: i64) {
    let mut n = ((value << 1) ^ (value >> 63)) as u64;
    while n >= 0x80 {
        out.push((n as u8) | 0x80);
        n >>= 7;
    }
    out.push(n as u8);
}

#[inline]
fn exact_i64(value: &Bound<'_, PyAny>) -> R<i64> {
    if !value.is_exact_instance_of::<PyInt>() {
        return Err(Reject);
    }
    value.extract::<i64>().map_err(|_| Reject)
}

impl RecordCodec {
    fn write(&self, node: &Node, value: &Bound<'_, PyAny>, out: &mut Vec<u8>) -> R<()> {
        match node {
            Node::Null => {
                if !value.is_none() {
                    return Err(Reject);
                }
            }
            Node::Boolean => {
                let b = value.downcast_exact::<PyBool>().map_err(|_| Reject)?;
                out.push(b.is_true() as u8);
            }
            Node::Int => {
                let v = exact_i64(value)?;
                if v < i32::MIN as i64 || v > i32::MAX as i64 {
                    return Err(Reject);
                }
                write_long(out, v);
            }
            Node::Long => write_long(out, exact_i64(value)?),
            Node::Float => {
                let f = value
                    .downcast_exact::<PyFloat>()
                    .map_err(|_| Reject)?
                    .value();
                let narrow = f as f32;
                if narrow.is_infinite() && f.is_finite() {
                    return Err(Reject); // struct.pack("<f") overflows here: let fastavro decide
                }
                out.extend_from_slice(&narrow.to_le_bytes());
            }
            Node::Double => {
                let f = value.downcast_exact::<PyFloat>().map_err(|_| Reject)?;
                out.extend_from_slice(&f.value().to_le_bytes());
            }
            Node::Str => {
                let s = value.downcast_exact::<PyString>().map_err(|_| Reject)?;
                let s = s.to_str().map_err(|_| Reject)?;
                write_long(out, s.len() as i64);
                out.extend_from_slice(s.as_bytes());
            }
            Node::Bytes => {
                let b = value.downcast_exact::<PyBytes>().map_err(|_| Reject)?;
                let b = b.as_bytes();
                write_long(out, b.len() as i64);
                out.extend_from_slice(b);
            }
            Node::Record(id) => {
                let fields = &self.records[*id].fields;
                // A tuple is the record's field values in schema order (the SDK's hot paths build no dicts).
                if let Ok(tuple) = value.downcast_exact::<PyTuple>() {
                    if tuple.len() != fields.len() {
                        return Err(Reject);
                    }
                    for ((_, field), item) in fields.iter().zip(tuple.iter()) {
                        self.write(field, &item, out)?;
                    }
                    return Ok(());
                }
                let dict = value.downcast_exact::<PyDict>().map_err(|_| Reject)?;
                for (key, field) in fields {
                    let item = dict
                        .get_item(key.bind(value.py()))
                        .map_err(|_| Reject)?
                        .ok_or(Reject)?;
                    self.write(field, &item, out)?;
                }
            }
            Node::Enum(id) => {
                let s = value.downcast_exact::<PyString>().map_err(|_| Reject)?;
                let s = s.to_str().map_err(|_| Reject)?;
                let index = *self.enums[*id].index.get(s).ok_or(Reject)?;
                write_long(out, index as i64);
            }
            Node::Array(items) => {
                let list = value.downcast_exact::<PyList>().map_err(|_| Reject)?;
                if !list.is_empty() {
                    write_long(out, list.len() as i64);
                    for item in list.iter() {
                        self.write(items, &item, out)?;
                    }
                }
                out.push(0);
            }
            Node::Map(values) => {
                let dict = value.downcast_exact::<PyDict>().map_err(|_| Reject)?;
                if !dict.is_empty() {
                    write_long(out, dict.len() as i64);
                    for (k, v) in dict.iter() {
                        let k = k.downcast_exact::<PyString>().map_err(|_| Reject)?;
                        let k = k.to_str().map_err(|_| Reject)?;
                        write_long(out, k.len() as i64);
                        out.extend_from_slice(k.as_bytes());
                        self.write(values, &v, out)?;
                    }
                }
                out.push(0);
            }
            Node::Nullable { null_first, inner } => {
                if value.is_none() {
                    out.push(if *null_first { 0 } else { 2 });
                } else {
                    out.push(if *null_first { 2 } else { 0 });
                    self.write(inner, value, out)?;
                }
            }
        }
        Ok(())
    }

    // --- reading ------------------------------------------------------------------------------------------------

    fn read<'py>(
        &self,
        py: Python<'py>,
        node: &Node,
        data: &[u8],
        pos: &mut usize,
        strings: &mut RecentStrings,
    ) -> R<Bound<'py, PyAny>> {
        Ok(match node {
            Node::Null => py.None().into_bound(py),
            Node::Boolean => {
                let b = *data.get(*pos).ok_or(Reject)?;
                *pos += 1;
                match b {
                    0 => PyBool::new(py, false).to_owned().into_any(),
                    1 => PyBool::new(py, true).to_owned().into_any(),
                    _ => return Err(Reject),
                }
            }
            Node::Int | Node::Long => read_long(data, pos)?
                .into_pyobject(py)
                .map_err(|_| Reject)?
                .into_any(),
            Node::Float => {
                let bytes: [u8; 4] = data
                    .get(*pos..*pos + 4)
                    .ok_or(Reject)?
                    .try_into()
                    .map_err(|_| Reject)?;
                *pos += 4;
                PyFloat::new(py, f32::from_le_bytes(bytes) as f64).into_any()
            }
            Node::Double => {
                let bytes: [u8; 8] = data
                    .get(*pos..*pos + 8)
                    .ok_or(Reject)?
                    .try_into()
                    .map_err(|_| Reject)?;
                *pos += 8;
                PyFloat::new(py, f64::from_le_bytes(bytes)).into_any()
            }
            Node::Str => {
                let raw = read_span(data, pos)?;
                let s = std::str::from_utf8(raw).map_err(|_| Reject)?;
                strings.get(py, s).into_any()
            }
            Node::Bytes => PyBytes::new(py, read_span(data, pos)?).into_any(),
            Node::Record(id) => {
                let dict = PyDict::new(py);
                for (key, field) in &self.records[*id].fields {
                    let value = self.read(py, field, data, pos, strings)?;
                    dict.set_item(key.bind(py), value).map_err(|_| Reject)?;
                }
                dict.into_any()
            }
            Node::Enum(id) => {
                let index = read_long(data, pos)?;
                let symbols = &self.enums[*id].symbols;
                if index < 0 || index as usize >= symbols.len() {
                    return Err(Reject);
                }
                symbols[index as usize].bind(py).clone().into_any()
            }
            Node::Array(items) => {
                let list = PyList::empty(py);
                loop {
                    let n = read_block_count(data, pos)?;
                    if n == 0 {
                        break;
                    }
                    for _ in 0..n {
                        list.append(self.read(py, items, data, pos, strings)?)
                            .map_err(|_| Reject)?;
                    }
                }
                list.into_any()
            }
            Node::Map(values) => {
                let dict = PyDict::new(py);
                loop {
                    let n = read_block_count(data, pos)?;
                    if n == 0 {
                        break;
                    }
                    for _ in 0..n {
                        let raw = read_span(data, pos)?;
                        let key = std::str::from_utf8(raw).map_err(|_| Reject)?;
                        let key = strings.get(py, key);
                        let value = self.read(py, values, data, pos, strings)?;
                        dict.set_item(key, value).map_err(|_| Reject)?;
                    }
                }
                dict.into_any()
            }
            Node::Nullable { null_first, inner } => {
                let index = read_long(data, pos)?;
                let is_null = match (index, null_first) {
                    (0, true) | (1, false) => true,
                    (1, true) | (0, false) => false,
                    _ => return Err(Reject),
                };
                if is_null {
                    py.None().into_bound(py)
                } else {
                    self.read(py, inner, data, pos, strings)?
                }
            }
        })
    }
}

#[inline(always)]
pub(crate) fn read_long(data: &[u8], pos: &mut usize) -> R<i64> {
    // One byte (a small number, a union branch, a short string's length): most longs read, without the loop.
    if let Some(&byte) = data.get(*pos) {
        if byte < 0x80 {
            *pos += 1;
            return Ok(((byte >> 1) as i64) ^ -((byte & 1) as i64));
        }
    }
    read_long_loop(data, pos)
}

fn read_long_loop(data: &[u8], pos: &mut usize) -> R<i64> {
    let mut n: u64 = 0;
    let mut shift = 0;
    loop {
        let byte = *data.get(*pos).ok_or(Reject)?;
        *pos += 1;
        if shift == 63 && byte > 1 {
            return Err(Reject);
        }
        n |= ((byte & 0x7F) as u64) << shift;
        if byte & 0x80 == 0 {
            break;
        }
        shift += 7;
        if shift > 63 {
            return Err(Reject);
        }
    }
    Ok(((n >> 1) as i64) ^ -((n & 1) as i64))
}

/// The item count of an array's or map's next block (0: the last one). A negative count is followed by the block's
/// size in bytes (Java writers use it to skip blocks), which reading item by item does not need.
#[inline]
pub(crate) fn read_block_count(data: &[u8], pos: &mut usize) -> R<i64> {
    let n = read_long(data, pos)?;
    if n >= 0 {
        return Ok(n);
    }
    read_long(data, pos)?;
    n.checked_neg().ok_or(Reject)
}

#[inline]
pub(crate) fn read_span<'a>(data: &'a [u8], pos: &mut usize) -> R<&'a [u8]> {
    let n = read_long(data, pos)?;
    if n < 0 {
        return Err(Reject);
    }
    let end = pos.checked_add(n as usize).ok_or(Reject)?;
    let raw = data.get(*pos..end).ok_or(Reject)?;
    *pos = end;
    Ok(raw)
}

#[pymethods]
impl RecordCodec {
    /// `schema_json`: the schema (named types defined where first used); ValueError for what it does not cover
    /// (logical types, fixed, unions other than null + one type).
    #[new]
    #[pyo3(signature = (schema_json, prefix = b"".to_vec()))]
    fn new(py: Python<'_>, schema_json: &str, prefix: Vec<u8>) -> PyResult<Self> {
        let schema: Value = serde_json::from_str(schema_json)
            .map_err(|e| PyValueError::new_err(format!("bad schema JSON: {e}")))?;
        let mut compiler = Compiler {
            py,
            records: Vec::new(),
            enums: Vec::new(),
            named: HashMap::new(),
        };
        let root = compiler.node(&schema, "")?;
        Ok(RecordCodec {
            root,
            records: compiler.records,
            enums: compiler.enums,
            prefix,
            recent: Mutex::new(RecentStrings::new()),
        })
    }

    /// prefix + the record's Avro binary; Refused when a value is not of its field's exact type.
    fn encode<'py>(
        &self,
        py: Python<'py>,
        record: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let mut out = Vec::with_capacity(self.prefix.len() + 256);
        out.extend_from_slice(&self.prefix);
        self.write(&self.root, record, &mut out)
            .map_err(|_| Refused::new_err("a value is not of its field's exact type"))?;
        Ok(PyBytes::new(py, &out))
    }

    /// (record, position after it), read from `data` at `pos`; Refused when the bytes are not well-formed.
    fn decode<'py>(
        &self,
        py: Python<'py>,
        data: &[u8],
        pos: usize,
    ) -> PyResult<(Bound<'py, PyAny>, usize)> {
        let mut at = pos;
        // Never waits: the lock is only ever held by a decode under the GIL, so it is busy only when this thread
        // re-entered decode (a finalizer run by a collection mid-read) or another one took the GIL while a
        // finalizer released it. Then this record's strings are all new objects. A poisoned lock still holds
        // valid strings.
        let mut held = match self.recent.try_lock() {
            Ok(guard) => Some(guard),
            Err(TryLockError::Poisoned(poisoned)) => Some(poisoned.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        };
        let mut uncached = RecentStrings::none();
        let strings = held.as_deref_mut().unwrap_or(&mut uncached);
        let record = self
            .read(py, &self.root, data, &mut at, strings)
            .map_err(|_| Refused::new_err("bytes not well-formed for the schema"))?;
        Ok((record, at))
    }
}
