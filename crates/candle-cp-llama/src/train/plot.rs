//! A dependency-free PNG writer and a line plot of loss curves.
//!
//! The PNG is 8-bit RGB, compressed by a tiny deflate encoder (one fixed-Huffman block, runs
//! only): valid zlib, larger than a real encoder's output but a few dozen lines instead of a
//! dependency.

use std::io::Write;
use std::path::Path;

/// CRC-32 (ISO-HDLC, as PNG uses).
fn crc32(bytes: &[u8]) -> u32 {
    let mut c = 0xFFFF_FFFFu32;
    for &b in bytes {
        c ^= b as u32;
        for _ in 0..8 {
            c = if c & 1 != 0 {
                0xEDB8_8320 ^ (c >> 1)
            } else {
                c >> 1
            };
        }
    }
    !c
}

/// Adler-32 checksum (zlib trailer).
fn adler32(bytes: &[u8]) -> u32 {
    let (mut a, mut b) = (1u32, 0u32);
    for &x in bytes {
        a = (a + x as u32) % 65521;
        b = (b + a) % 65521;
    }
    (b << 16) | a
}

/// LSB-first bit writer for deflate.
struct Bits {
    out: Vec<u8>,
    acc: u64,
    n: u32,
}

impl Bits {
    fn put(&mut self, value: u32, count: u32) {
        self.acc |= (value as u64) << self.n;
        self.n += count;
        while self.n >= 8 {
            self.out.push(self.acc as u8);
            self.acc >>= 8;
            self.n -= 8;
        }
    }
    /// A Huffman code (written most-significant bit first).
    fn code(&mut self, code: u32, len: u32) {
        let mut rev = 0;
        for i in 0..len {
            rev |= ((code >> i) & 1) << (len - 1 - i);
        }
        self.put(rev, len);
    }
    fn finish(mut self) -> Vec<u8> {
        if self.n > 0 {
            self.out.push(self.acc as u8);
        }
        self.out
    }
}

const LEN_BASE: [u16; 29] = [
    3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 15, 17, 19, 23, 27, 31, 35, 43, 51, 59, 67, 83, 99, 115, 131,
    163, 195, 227, 258,
];
const LEN_EXTRA: [u8; 29] = [
    0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 0,
];

/// Fixed-Huffman code of literal/length symbol `sym` (RFC 1951 §3.2.6): (code, bits).
fn fixed_code(sym: u32) -> (u32, u32) {
    match sym {
        0..=143 => (0x30 + sym, 8),
        144..=255 => (0x190 + sym - 144, 9),
        256..=279 => (sym - 256, 7),
        _ => (0xC0 + sym - 280, 8),
    }
}

/// zlib stream of `data`: one fixed-Huffman deflate block whose only matches are runs
/// (distance 1) — plots are mostly long runs of one colour, so this is ~50× smaller than
/// stored blocks, in a few lines.
fn zlib_rle(data: &[u8]) -> Vec<u8> {
    let mut w = Bits {
        out: vec![0x78, 0x01],
        acc: 0,
        n: 0,
    };
    w.put(1, 1); // BFINAL
    w.put(1, 2); // BTYPE = fixed Huffman
    let mut i = 0;
    while i < data.len() {
        let mut run = 0;
        if i > 0 {
            while run < 258 && i + run < data.len() && data[i + run] == data[i - 1] {
                run += 1;
            }
        }
        if run >= 3 {
            let k = LEN_BASE
                .iter()
                .rposition(|&b| b as usize <= run)
                .unwrap_or(0);
            let (c, l) = fixed_code(257 + k as u32);
            w.code(c, l);
            w.put((run - LEN_BASE[k] as usize) as u32, LEN_EXTRA[k] as u32);
            w.code(0, 5); // distance code 0 = distance 1
            i += run;
        } else {
            let (c, l) = fixed_code(data[i] as u32);
            w.code(c, l);
            i += 1;
        }
    }
    let (c, l) = fixed_code(256);
    w.code(c, l);
    let mut out = w.finish();
    out.extend_from_slice(&adler32(data).to_be_bytes());
    out
}

/// Encode an RGB image (`rgb.len() == 3·w·h`, rows top to bottom) as PNG bytes.
pub fn encode_png(w: usize, h: usize, rgb: &[u8]) -> Vec<u8> {
    let mut raw = Vec::with_capacity((3 * w + 1) * h);
    for row in rgb.chunks(3 * w).take(h) {
        raw.push(0); // filter: none
        raw.extend_from_slice(row);
    }
    let mut png = vec![0x89, b'P', b'N', b'G', b'\r', b'\n', 0x1A, b'\n'];
    let mut chunk = |kind: &[u8; 4], body: &[u8]| {
        png.extend_from_slice(&(body.len() as u32).to_be_bytes());
        let mut c = kind.to_vec();
        c.extend_from_slice(body);
        png.extend_from_slice(&c);
        png.extend_from_slice(&crc32(&c).to_be_bytes());
    };
    let mut ihdr = Vec::new();
    ihdr.extend_from_slice(&(w as u32).to_be_bytes());
    ihdr.extend_from_slice(&(h as u32).to_be_bytes());
    ihdr.extend_from_slice(&[8, 2, 0, 0, 0]); // 8-bit, RGB, deflate, no filter, no interlace
    chunk(b"IHDR", &ihdr);
    chunk(b"IDAT", &zlib_rle(&raw));
    chunk(b"IEND", &[]);
    png
}

/// A simple RGB canvas.
struct Canvas {
    w: usize,
    h: usize,
    px: Vec<u8>,
}

impl Canvas {
    fn new(w: usize, h: usize) -> Self {
        Self {
            w,
            h,
            px: vec![255; 3 * w * h],
        }
    }
    fn set(&mut self, x: i64, y: i64, c: [u8; 3]) {
        if x >= 0 && y >= 0 && (x as usize) < self.w && (y as usize) < self.h {
            let i = 3 * (y as usize * self.w + x as usize);
            self.px[i..i + 3].copy_from_slice(&c);
        }
    }
    fn line(&mut self, (x0, y0): (f64, f64), (x1, y1): (f64, f64), c: [u8; 3], thick: i64) {
        let n = ((x1 - x0).abs().max((y1 - y0).abs()).ceil() as usize).max(1);
        for i in 0..=n {
            let t = i as f64 / n as f64;
            let (x, y) = (
                (x0 + t * (x1 - x0)).round() as i64,
                (y0 + t * (y1 - y0)).round() as i64,
            );
            for dx in 0..thick {
                for dy in 0..thick {
                    self.set(x + dx - thick / 2, y + dy - thick / 2, c);
                }
            }
        }
    }
    /// Draw `text` (digits, '.', '-', 'e', letters a few) with a 3×5 font, scale `s`.
    fn text(&mut self, x: i64, y: i64, text: &str, c: [u8; 3], s: i64) {
        for (k, ch) in text.chars().enumerate() {
            let g = glyph(ch);
            for (row, bits) in g.iter().enumerate() {
                for col in 0..3 {
                    if bits & (0b100 >> col) != 0 {
                        for dx in 0..s {
                            for dy in 0..s {
                                self.set(
                                    x + (k as i64 * 4 + col) * s + dx,
                                    y + row as i64 * s + dy,
                                    c,
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

/// 3×5 bitmap glyphs (rows top to bottom, 3 bits each); unknown characters are blank.
fn glyph(c: char) -> [u8; 5] {
    match c.to_ascii_lowercase() {
        '0' => [7, 5, 5, 5, 7],
        '1' => [2, 6, 2, 2, 7],
        '2' => [7, 1, 7, 4, 7],
        '3' => [7, 1, 7, 1, 7],
        '4' => [5, 5, 7, 1, 1],
        '5' => [7, 4, 7, 1, 7],
        '6' => [7, 4, 7, 5, 7],
        '7' => [7, 1, 1, 1, 1],
        '8' => [7, 5, 7, 5, 7],
        '9' => [7, 5, 7, 1, 7],
        '.' => [0, 0, 0, 0, 2],
        '-' => [0, 0, 7, 0, 0],
        'e' => [7, 4, 7, 4, 7],
        'l' => [4, 4, 4, 4, 7],
        'o' => [7, 5, 5, 5, 7],
        's' => [7, 4, 7, 1, 7],
        't' => [7, 2, 2, 2, 2],
        'p' => [7, 5, 7, 4, 4],
        'r' => [7, 5, 6, 5, 5],
        'n' => [6, 5, 5, 5, 5],
        'g' => [7, 4, 5, 5, 7],
        'a' => [7, 5, 7, 5, 5],
        'i' => [7, 2, 2, 2, 7],
        'd' => [6, 5, 5, 5, 6],
        'm' => [5, 7, 7, 5, 5],
        'c' => [7, 4, 4, 4, 7],
        'h' => [5, 5, 7, 5, 5],
        'u' => [5, 5, 5, 5, 7],
        'v' => [5, 5, 5, 5, 2],
        'w' => [5, 5, 7, 7, 5],
        'k' => [5, 5, 6, 5, 5],
        'f' => [7, 4, 6, 4, 4],
        'b' => [6, 5, 6, 5, 6],
        'y' => [5, 5, 7, 2, 2],
        '=' => [0, 7, 0, 7, 0],
        '/' => [1, 1, 2, 4, 4],
        '(' => [1, 2, 2, 2, 1],
        ')' => [4, 2, 2, 2, 4],
        _ => [0; 5],
    }
}

/// Short label for an axis value.
fn fmt_tick(v: f64) -> String {
    if v == 0.0 {
        "0".into()
    } else if v.abs() >= 1000.0 || v.abs() < 0.01 {
        format!("{v:.1e}")
    } else if v.abs() >= 10.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.2}")
    }
}

/// One curve: legend label, colour, (x, y) points (non-finite y values are skipped).
pub struct Series<'a> {
    /// Legend text.
    pub label: &'a str,
    /// RGB colour.
    pub color: [u8; 3],
    /// Points in data coordinates.
    pub points: &'a [(f64, f64)],
}

/// Render `series` as a `w × h` line plot with axes, ticks and a legend; returns PNG bytes.
pub fn line_plot_png(w: usize, h: usize, series: &[Series]) -> Vec<u8> {
    let mut cv = Canvas::new(w, h);
    let (left, right, top, bottom) = (70.0, 20.0, 20.0, 40.0);
    let pts = series
        .iter()
        .flat_map(|s| s.points.iter())
        .filter(|p| p.0.is_finite() && p.1.is_finite());
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in pts {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    if x0 > x1 {
        (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
    }
    y0 = y0.min(0.0);
    if x1 - x0 < 1e-12 {
        x1 = x0 + 1.0;
    }
    if y1 - y0 < 1e-12 {
        y1 = y0 + 1.0;
    }
    y1 += 0.05 * (y1 - y0);
    let (pw, ph) = (w as f64 - left - right, h as f64 - top - bottom);
    let to_px = |x: f64, y: f64| {
        (
            left + (x - x0) / (x1 - x0) * pw,
            top + (1.0 - (y - y0) / (y1 - y0)) * ph,
        )
    };
    let grey = [200, 200, 200];
    let black = [0, 0, 0];
    for i in 0..=5 {
        let fy = y0 + (y1 - y0) * i as f64 / 5.0;
        let (_, py) = to_px(x0, fy);
        cv.line((left, py), (left + pw, py), grey, 1);
        cv.text(4, py as i64 - 5, &fmt_tick(fy), black, 2);
        let fx = x0 + (x1 - x0) * i as f64 / 5.0;
        let (px, _) = to_px(fx, y0);
        cv.line((px, top), (px, top + ph), grey, 1);
        cv.text(
            px as i64 - 10,
            (top + ph) as i64 + 8,
            &fmt_tick(fx),
            black,
            2,
        );
    }
    cv.line((left, top), (left, top + ph), black, 2);
    cv.line((left, top + ph), (left + pw, top + ph), black, 2);
    for (k, s) in series.iter().enumerate() {
        let mut prev: Option<(f64, f64)> = None;
        for &(x, y) in s.points {
            if !(x.is_finite() && y.is_finite()) {
                prev = None;
                continue;
            }
            let p = to_px(x, y);
            if let Some(q) = prev {
                cv.line(q, p, s.color, 2);
            }
            prev = Some(p);
        }
        let ly = top as i64 + 8 + 16 * k as i64;
        let lx = (left + pw) as i64 - 230;
        cv.line(
            (lx as f64, ly as f64 + 4.0),
            (lx as f64 + 24.0, ly as f64 + 4.0),
            s.color,
            3,
        );
        cv.text(lx + 30, ly, s.label, black, 2);
    }
    encode_png(w, h, &cv.px)
}

/// Write [`line_plot_png`] to `path` (through a temporary file and a rename).
pub fn write_line_plot(
    path: impl AsRef<Path>,
    w: usize,
    h: usize,
    series: &[Series],
) -> std::io::Result<()> {
    let path = path.as_ref();
    let tmp = path.with_extension("png.tmp");
    std::fs::File::create(&tmp)?.write_all(&line_plot_png(w, h, series))?;
    std::fs::rename(tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksums_match_known_values() {
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
        assert_eq!(crc32(b"IEND"), 0xAE42_6082);
        assert_eq!(adler32(b"Wikipedia"), 0x11E6_0398);
    }

    #[test]
    fn png_structure_is_valid() {
        let pts: Vec<(f64, f64)> = (0..50)
            .map(|i| (i as f64, 5.0 / (1.0 + i as f64)))
            .collect();
        let png = line_plot_png(
            320,
            200,
            &[Series {
                label: "loss",
                color: [200, 0, 0],
                points: &pts,
            }],
        );
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
        // Walk the chunks, checking each CRC, and inflate the stored blocks back.
        let mut i = 8;
        let mut kinds = vec![];
        let mut idat = vec![];
        while i < png.len() {
            let n = u32::from_be_bytes(png[i..i + 4].try_into().unwrap()) as usize;
            let kind = &png[i + 4..i + 8];
            let crc = u32::from_be_bytes(png[i + 8 + n..i + 12 + n].try_into().unwrap());
            assert_eq!(crc, crc32(&png[i + 4..i + 8 + n]));
            if kind == b"IDAT" {
                idat.extend_from_slice(&png[i + 8..i + 8 + n]);
            }
            kinds.push(String::from_utf8(kind.to_vec()).unwrap());
            i += 12 + n;
        }
        assert_eq!(kinds, ["IHDR", "IDAT", "IEND"]);
        let (raw, j) = inflate_fixed(&idat[2..]);
        let j = j + 2;
        assert_eq!(
            u32::from_be_bytes(idat[j..j + 4].try_into().unwrap()),
            adler32(&raw)
        );
        assert_eq!(raw.len(), (320 * 3 + 1) * 200);
        // Something red was drawn.
        assert!(raw
            .chunks(320 * 3 + 1)
            .any(|row| row[1..].chunks(3).any(|p| p == [200, 0, 0])));
        assert!(
            png.len() < raw.len() / 10,
            "{} bytes for {} raw",
            png.len(),
            raw.len()
        );
    }

    /// Decoder for the subset `zlib_rle` emits (one fixed-Huffman block, distance-1 matches);
    /// returns the bytes and the offset just after the block (byte-aligned).
    fn inflate_fixed(d: &[u8]) -> (Vec<u8>, usize) {
        let mut pos = 0usize; // bit position
        let bit = |pos: &mut usize| {
            let b = (d[*pos / 8] >> (*pos % 8)) & 1;
            *pos += 1;
            b as u32
        };
        let bits = |pos: &mut usize, n: u32| (0..n).fold(0, |acc, i| acc | (bit(pos) << i));
        assert_eq!(bits(&mut pos, 1), 1, "BFINAL");
        assert_eq!(bits(&mut pos, 2), 1, "BTYPE fixed");
        let mut out: Vec<u8> = vec![];
        loop {
            // Read a fixed code: 7 bits first, extend to 8 / 9 as the ranges require.
            let mut code = 0u32;
            for _ in 0..7 {
                code = (code << 1) | bit(&mut pos);
            }
            let sym = if code <= 0x17 {
                code + 256
            } else {
                code = (code << 1) | bit(&mut pos);
                if (0x30..=0xBF).contains(&code) {
                    code - 0x30
                } else if (0xC0..=0xC7).contains(&code) {
                    code - 0xC0 + 280
                } else {
                    code = (code << 1) | bit(&mut pos);
                    code - 0x190 + 144
                }
            };
            match sym {
                0..=255 => out.push(sym as u8),
                256 => break,
                _ => {
                    let k = (sym - 257) as usize;
                    let len = LEN_BASE[k] as usize + bits(&mut pos, LEN_EXTRA[k] as u32) as usize;
                    let mut dist = 0;
                    for _ in 0..5 {
                        dist = (dist << 1) | bit(&mut pos);
                    }
                    assert_eq!(dist, 0, "only distance 1 is emitted");
                    let last = *out.last().unwrap();
                    out.extend(std::iter::repeat_n(last, len));
                }
            }
        }
        (out, pos.div_ceil(8))
    }

    #[test]
    fn deflate_round_trips_runs_and_literals() {
        let mut data = vec![7u8; 1000];
        data.extend((0..=255u8).cycle().take(700));
        data.extend([1, 1, 1, 2, 2, 9, 9, 9, 9]);
        let z = zlib_rle(&data);
        let (back, j) = inflate_fixed(&z[2..]);
        assert_eq!(back, data);
        assert_eq!(
            u32::from_be_bytes(z[j + 2..j + 6].try_into().unwrap()),
            adler32(&data)
        );
        assert_eq!(z.len(), j + 6);
    }
}
