//! Exact bit-level helpers shared by the runtime's checks: an FNV-1a hash over f32 bit
//! patterns (message checksums, replica and checkpoint comparisons) and the exact carriage of
//! 64-bit words in f32 payloads (integers below 2^24 are exact in f32, so a word travels as
//! three 22-bit pieces through an ordinary all-gather).

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0100_0000_01b3;

/// FNV-1a over the bit patterns of `values`: equal only if every value is bit-identical.
pub fn fnv1a_f32(values: impl IntoIterator<Item = f32>) -> u64 {
    fnv1a_f32_from(FNV_OFFSET, values)
}

/// Continues an [`fnv1a_f32`] hash `h` over more values.
pub fn fnv1a_f32_from(h: u64, values: impl IntoIterator<Item = f32>) -> u64 {
    values.into_iter().fold(h, |h, v| {
        (h ^ u64::from(v.to_bits())).wrapping_mul(FNV_PRIME)
    })
}

/// FNV-1a over bytes (names derived from secrets, such as a job's shared-memory tag).
pub fn fnv1a_bytes(bytes: impl IntoIterator<Item = u8>) -> u64 {
    bytes.into_iter().fold(FNV_OFFSET, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(FNV_PRIME)
    })
}

const PIECE_BITS: u32 = 22;

/// `word` as three f32 values, each an exact integer below 2^22.
pub fn word_to_f32s(word: u64) -> [f32; 3] {
    [0, 1, 2].map(|i| ((word >> (i * PIECE_BITS)) & ((1 << PIECE_BITS) - 1)) as f32)
}

/// Inverse of [`word_to_f32s`] (the first three values of `v`; missing ones count as 0).
pub fn f32s_to_word(v: &[f32]) -> u64 {
    v.iter()
        .take(3)
        .enumerate()
        .fold(0, |w, (i, &x)| w | ((x as u64) << (i as u32 * PIECE_BITS)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_round_trip_and_hashes_see_every_bit() {
        for w in [0, 1, u64::MAX, 0x0123_4567_89ab_cdef] {
            assert_eq!(f32s_to_word(&word_to_f32s(w)), w);
        }
        assert_ne!(fnv1a_f32([0.0]), fnv1a_f32([-0.0]));
        // The published FNV-1a 64 test vectors.
        assert_eq!(fnv1a_bytes(*b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a_bytes(*b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(
            fnv1a_f32([1.0, 2.0]),
            fnv1a_f32_from(fnv1a_f32([1.0]), [2.0])
        );
    }
}
