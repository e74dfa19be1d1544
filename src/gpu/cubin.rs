//! What a CUBIN says about its kernels, for the tests: their stack frames (a kernel that copies
//! its arguments or arrays to the stack reads local memory on every use: rotary's operand copy,
//! 224 bytes a thread, made it 1.6x slower than the element-wise kernel before it), their
//! parameters' sizes, and their code sizes and register counts.
//!
//! A CUBIN is a little-endian ELF64 file. Its `.nv.info` section is a list of attribute
//! records: a format byte, an attribute byte, then for format 4 (sized) a 16-bit size and that
//! many bytes, for the other formats a 16-bit value. EIATTR_MIN_STACK_SIZE (0x12) carries
//! (function symbol index, bytes), as `cuobjdump -res-usage` reports as STACK.

const EIFMT_SVAL: u8 = 4;
const EIATTR_MIN_STACK_SIZE: u8 = 0x12;

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

fn u64_at(b: &[u8], at: usize) -> Option<usize> {
    usize::try_from(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?)).ok()
}

/// Every section's name, file offset and size in bytes (a section without file data, such as
/// shared memory's, has a size too).
fn sections(elf: &[u8]) -> Option<Vec<(String, usize, usize)>> {
    let (shoff, shentsize) = (u64_at(elf, 0x28)?, usize::from(u16_at(elf, 0x3a)?));
    let (shnum, shstrndx) = (
        usize::from(u16_at(elf, 0x3c)?),
        usize::from(u16_at(elf, 0x3e)?),
    );
    let header = |i: usize| shoff + i * shentsize;
    let place = |i: usize| Some((u64_at(elf, header(i) + 24)?, u64_at(elf, header(i) + 32)?));
    let (names_at, names_size) = place(shstrndx)?;
    let names = elf.get(names_at..names_at + names_size)?;
    (0..shnum)
        .map(|i| {
            let start = usize::try_from(u32_at(elf, header(i))?).ok()?;
            let rest = names.get(start..)?;
            let end = rest.iter().position(|&c| c == 0)?;
            let (offset, size) = place(i)?;
            Some((
                String::from_utf8_lossy(&rest[..end]).into_owned(),
                offset,
                size,
            ))
        })
        .collect()
}

/// The bytes of the section named `name`.
fn section<'a>(elf: &'a [u8], name: &str) -> Option<&'a [u8]> {
    let (_, offset, size) = sections(elf)?.into_iter().find(|(n, _, _)| n == name)?;
    elf.get(offset..offset + size)
}

/// The sized records (format EIFMT_SVAL) of a `.nv.info` section: (attribute, payload). A
/// record is a format byte, an attribute byte, then for format 4 a 16-bit size and that many
/// bytes, for the other formats a 16-bit value; an error where one runs past the section.
fn sized_records(info: &[u8]) -> Result<Vec<(u8, &[u8])>, String> {
    let (mut at, mut records) = (0, Vec::new());
    while at + 4 <= info.len() {
        let (format, attribute) = (info[at], info[at + 1]);
        let size = if format == EIFMT_SVAL {
            usize::from(u16_at(info, at + 2).ok_or("truncated record")?)
        } else {
            0
        };
        let payload = info.get(at + 4..at + 4 + size).ok_or("truncated record")?;
        if format == EIFMT_SVAL {
            records.push((attribute, payload));
        }
        at += 4 + size;
    }
    if at != info.len() {
        return Err("malformed .nv.info".into());
    }
    Ok(records)
}

/// The u32 values of the (function symbol, u32) records of `attribute` in a `.nv.info` section.
fn per_function_values(info: &[u8], attribute: u8) -> Result<Vec<u32>, String> {
    Ok(sized_records(info)?
        .into_iter()
        .filter(|&(a, payload)| a == attribute && payload.len() == 8)
        .filter_map(|(_, payload)| u32_at(payload, 4))
        .collect())
}

/// What a CUBIN's code is, kernel by kernel, for comparing two builds of the same source (a
/// change to how arguments arrive should leave it unchanged): each `.text.<kernel>` section's
/// size in bytes (16 per instruction), sorted by name, and the register counts of its
/// functions (EIATTR_REGCOUNT, sorted).
pub fn code_summary(cubin: &[u8]) -> Result<String, String> {
    const EIATTR_REGCOUNT: u8 = 0x2f;
    let sections = sections(cubin).ok_or("not an ELF64 file")?;
    let mut text: Vec<String> = sections
        .iter()
        .filter_map(|(name, _, size)| {
            let kernel = name.strip_prefix(".text.")?;
            Some(format!("{kernel}:{size}"))
        })
        .collect();
    text.sort();
    let info = section(cubin, ".nv.info").ok_or("no .nv.info section")?;
    let mut registers = per_function_values(info, EIATTR_REGCOUNT)?;
    registers.sort_unstable();
    Ok(format!("{} regs {registers:?}", text.join(" ")))
}

/// The size in bytes of each parameter of kernel `kernel`, in parameter order, from its
/// `.nv.info.<kernel>` section's parameter records: index u32, ordinal u16, offset u16, then a
/// u32 whose bits 18..32 are the size (EIATTR_KPARAM_INFO, as `cuobjdump -elf` shows them), or
/// that is the size (EIATTR_KPARAM_INFO_V2, which NVRTC 13 writes for a kernel with a
/// parameter too large for the first's 14 bits, such as adam's 32 KB struct: read from its
/// CUBINs).
pub fn kernel_param_sizes(cubin: &[u8], kernel: &str) -> Result<Vec<u32>, String> {
    const EIATTR_KPARAM_INFO: u8 = 0x17;
    const EIATTR_KPARAM_INFO_V2: u8 = 0x45;
    let info = section(cubin, &format!(".nv.info.{kernel}"))
        .ok_or_else(|| format!("no .nv.info.{kernel} section"))?;
    let mut params: Vec<(u16, u32)> = sized_records(info)?
        .into_iter()
        .filter(|&(a, payload)| {
            (a == EIATTR_KPARAM_INFO || a == EIATTR_KPARAM_INFO_V2) && payload.len() == 12
        })
        .filter_map(|(a, payload)| {
            let (ordinal, bits) = (u16_at(payload, 4)?, u32_at(payload, 8)?);
            Some((
                ordinal,
                if a == EIATTR_KPARAM_INFO_V2 {
                    bits
                } else {
                    bits >> 18
                },
            ))
        })
        .collect();
    params.sort_unstable();
    if params
        .iter()
        .enumerate()
        .any(|(i, &(o, _))| usize::from(o) != i)
    {
        return Err(format!("{kernel}: parameter ordinals {params:?}"));
    }
    Ok(params.into_iter().map(|(_, size)| size).collect())
}

/// The largest stack frame of any kernel in `cubin`, in bytes; an error for what is not a
/// CUBIN with a `.nv.info` section.
pub fn max_stack_bytes(cubin: &[u8]) -> Result<u32, String> {
    if cubin.get(..4) != Some(b"\x7fELF".as_slice()) || cubin.get(4) != Some(&2) {
        return Err("not an ELF64 file".into());
    }
    let info = section(cubin, ".nv.info").ok_or("no .nv.info section")?;
    let frames = per_function_values(info, EIATTR_MIN_STACK_SIZE)?;
    Ok(frames.into_iter().max().unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal ELF64 with a section-name table and one `.nv.info` holding `info`.
    fn elf_with_info(info: &[u8]) -> Vec<u8> {
        let names = b"\0.shstrtab\0.nv.info\0";
        let mut elf = vec![0u8; 64];
        elf[..5].copy_from_slice(b"\x7fELF\x02");
        let names_at = elf.len();
        elf.extend_from_slice(names);
        let info_at = elf.len();
        elf.extend_from_slice(info);
        let shoff = elf.len();
        elf[0x28..0x30].copy_from_slice(&(shoff as u64).to_le_bytes());
        elf[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes());
        elf[0x3c..0x3e].copy_from_slice(&3u16.to_le_bytes());
        elf[0x3e..0x40].copy_from_slice(&1u16.to_le_bytes());
        for (name, offset, size) in [
            (0u32, 0usize, 0usize),
            (1, names_at, names.len()),
            (11, info_at, info.len()),
        ] {
            let mut header = [0u8; 64];
            header[..4].copy_from_slice(&name.to_le_bytes());
            header[24..32].copy_from_slice(&(offset as u64).to_le_bytes());
            header[32..40].copy_from_slice(&(size as u64).to_le_bytes());
            elf.extend_from_slice(&header);
        }
        elf
    }

    #[test]
    fn reads_the_largest_stack_frame_among_the_records() {
        // REGCOUNT (sym 9: 64), FRAME_SIZE (sym 9: 224), a 16-bit value record, two
        // MIN_STACK_SIZE records (sym 6: 16, sym 9: 224): what NVRTC wrote for rotary.
        let info = [
            &[4u8, 0x2f, 8, 0, 9, 0, 0, 0, 64, 0, 0, 0][..],
            &[4, 0x11, 8, 0, 9, 0, 0, 0, 0xe0, 0, 0, 0],
            &[3, 0x1b, 0xff, 0],
            &[4, 0x12, 8, 0, 6, 0, 0, 0, 16, 0, 0, 0],
            &[4, 0x12, 8, 0, 9, 0, 0, 0, 0xe0, 0, 0, 0],
        ]
        .concat();
        assert_eq!(max_stack_bytes(&elf_with_info(&info)), Ok(224));
        assert_eq!(max_stack_bytes(&elf_with_info(&info[..12])), Ok(0));
        assert!(max_stack_bytes(&elf_with_info(&info[..10])).is_err());
        assert!(max_stack_bytes(b"not an elf").is_err());
    }
}
