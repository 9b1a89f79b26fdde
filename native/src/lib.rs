//! treadle's native hot paths, as a CPython extension module (`treadle_native`).
//!
//! The Python code stays the reference: every native function has a pure-Python twin that treadle uses when
//! this module is not installed, and tests compare the two (tests/test_avro_native.py).

use pyo3::prelude::*;

mod avro;
mod columns;
mod ids;
mod schema;

#[pymodule]
fn treadle_native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<avro::RecordCodec>()?;
    m.add_class::<columns::NativeBlockWriter>()?;
    m.add_function(wrap_pyfunction!(ids::uuid7, m)?)?;
    m.add_function(wrap_pyfunction!(ids::uuid7_forget, m)?)?;
    m.add("Refused", m.py().get_type::<avro::Refused>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
