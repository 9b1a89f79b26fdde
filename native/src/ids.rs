//! UUIDv7 text ids for new events: the SDK makes one per event, so the Python version (topics.ids.uuid7_py, the
//! reference) is a visible share of its CPU. Same layout: 48-bit Unix milliseconds, version 7, variant 10, 74 random
//! bits read from /dev/urandom a block at a time. A forked child must not reuse its parent's block: topics.ids calls
//! `uuid7_forget` after os.fork (os.register_at_fork), as it clears its own block.

use std::cell::RefCell;
use std::fs::File;
use std::io::Read;
use std::time::{SystemTime, UNIX_EPOCH};

use pyo3::exceptions::PyOSError;
use pyo3::prelude::*;

const BLOCK: usize = 10 * 256; // random bytes for 256 ids (10 of each id's 16 bytes are random)
const HEX: &[u8; 16] = b"0123456789abcdef";

struct Pool {
    bytes: Vec<u8>,
    used: usize,
}

thread_local! {
    // per thread (the GIL is held while it is used); refilled when empty
    static POOL: RefCell<Pool> = const { RefCell::new(Pool { bytes: Vec::new(), used: 0 }) };
}

fn random10(out: &mut [u8; 10]) -> std::io::Result<()> {
    POOL.with(|cell| {
        let mut pool = cell.borrow_mut();
        if pool.used + 10 > pool.bytes.len() {
            let mut block = vec![0u8; BLOCK];
            File::open("/dev/urandom")?.read_exact(&mut block)?;
            pool.bytes = block;
            pool.used = 0;
        }
        out.copy_from_slice(&pool.bytes[pool.used..pool.used + 10]);
        pool.used += 10;
        Ok(())
    })
}

/// The id's text for Unix milliseconds `ms` and random bytes `r`: tttttttt-tttt-7rrr-vrrr-rrrrrrrrrrrr.
fn format(ms: u64, r: &[u8; 10]) -> String {
    let mut b = [0u8; 16];
    b[..6].copy_from_slice(&(ms & 0xFFFF_FFFF_FFFF).to_be_bytes()[2..]);
    b[6] = 0x70 | (r[0] & 0x0F);
    b[7] = r[1];
    b[8] = 0x80 | (r[2] & 0x3F);
    b[9..].copy_from_slice(&r[3..]);
    let mut text = Vec::with_capacity(36);
    for (i, byte) in b.iter().enumerate() {
        if i == 4 || i == 6 || i == 8 || i == 10 {
            text.push(b'-');
        }
        text.push(HEX[(byte >> 4) as usize]);
        text.push(HEX[(byte & 0x0F) as usize]);
    }
    String::from_utf8(text).expect("hex digits and dashes are ASCII")
}

/// A UUIDv7 as text (RFC 9562), for `unix_ms` or now.
#[pyfunction]
#[pyo3(signature = (unix_ms=None))]
pub fn uuid7(unix_ms: Option<u64>) -> PyResult<String> {
    let ms = match unix_ms {
        Some(ms) => ms,
        None => SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0),
    };
    let mut r = [0u8; 10];
    random10(&mut r).map_err(|e| PyOSError::new_err(format!("cannot read /dev/urandom: {e}")))?;
    Ok(format(ms, &r))
}

/// Drop this thread's random bytes (in a forked child: they are its parent's too).
#[pyfunction]
pub fn uuid7_forget() {
    POOL.with(|cell| {
        let mut pool = cell.borrow_mut();
        pool.bytes.clear();
        pool.used = 0;
    });
}
