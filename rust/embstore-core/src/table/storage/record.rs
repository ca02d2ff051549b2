//! A disk table's record: `key (i64) | save generation (u32) | CRC-32C
//! (u32) | the row's words` (its stored weights, optimizer state and 4
//! metadata words), and where a key's record is ([`Loc`]).

use crate::error::{Result, ckpt_err};
pub(crate) use crate::record::Loc;

/// Bytes before a record's words: key, generation, CRC.
pub(crate) const HEAD: usize = 16;

pub(crate) fn crc_of(key: i64, generation: u32, body: &[u8]) -> u32 {
    let c = crc32c::crc32c(&key.to_le_bytes());
    let c = crc32c::crc32c_append(c, &generation.to_le_bytes());
    crc32c::crc32c_append(c, body)
}

pub(crate) fn encode(key: i64, generation: u32, words: &[u32], out: &mut Vec<u8>) {
    let start = out.len();
    out.extend_from_slice(&key.to_le_bytes());
    out.extend_from_slice(&generation.to_le_bytes());
    out.extend_from_slice(&[0; 4]);
    for w in words {
        out.extend_from_slice(&w.to_le_bytes());
    }
    let crc = crc_of(key, generation, &out[start + HEAD..]);
    out[start + 12..start + 16].copy_from_slice(&crc.to_le_bytes());
}

pub(crate) fn decode(rec: &[u8], key: i64, generation: u32, words: &mut [u32]) -> Result<()> {
    let got = i64::from_le_bytes(rec[..8].try_into().expect("8 bytes"));
    let gen_ = u32::from_le_bytes(rec[8..12].try_into().expect("4 bytes"));
    let crc = u32::from_le_bytes(rec[12..16].try_into().expect("4 bytes"));
    let body = &rec[HEAD..];
    let whole = got == key && gen_ == generation && crc == crc_of(got, gen_, body);
    decode_body(body, key, whole, words)
}

/// `body`'s words into `words` if the check that read it held (`whole`).
pub(crate) fn decode_body(body: &[u8], key: i64, whole: bool, words: &mut [u32]) -> Result<()> {
    if !whole {
        return Err(ckpt_err(
            "disk store",
            format!("the row of key {key} is damaged (its record fails its check)"),
        ));
    }
    for (w, b) in words.iter_mut().zip(body.chunks_exact(4)) {
        *w = u32::from_le_bytes(b.try_into().expect("4 bytes"));
    }
    Ok(())
}
