//! Kernel arguments as one `#[repr(C)]` struct per kernel, declared with `kernel_args!`: the
//! launch fills the struct by field name and passes each field as the kernel's parameter of
//! the same place (`push`), instead of a positional list of `.arg()` calls tied to the kernel's
//! signature by a comment. The kernel keeps its plain parameter list, so the code NVRTC makes
//! is unchanged (a struct parameter would lose its pointers' `__restrict__` and changed the
//! norm kernels' register counts). The registry test that compiles every variant holds the two
//! together on every machine: the struct's fields against the kernel's parameters, by name
//! (the signature in the kernel's source) and by size (what the CUBIN records per parameter).

use cudarc::driver::LaunchArgs;

/// One field of a kernel's argument struct.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Field {
    pub name: &'static str,
    pub offset: usize,
    pub size: usize,
}

/// A kernel's argument struct (made by `kernel_args!`): plain data, device pointers as `u64`.
///
/// # Safety
/// `FIELDS` are the struct's own fields: each offset and size lies within the struct (what
/// `kernel_args!` writes with `offset_of!` and `size_of`; implement it only through the macro).
pub unsafe trait KernelArgs: Copy {
    /// Every field, in declaration order: the kernel's parameters, in order.
    const FIELDS: &'static [Field];
}

/// Passes `args` to the launch: each field as the kernel's parameter of its place.
pub fn push<'a, A: KernelArgs>(launch: &mut LaunchArgs<'a>, args: &'a A) {
    use cudarc::driver::PushKernelArg;
    let base = (args as *const A).cast::<u8>();
    for field in A::FIELDS {
        // SAFETY: `offset` is a field's offset within `*args` (KernelArgs' contract), so the
        // pointer is in bounds, to initialized bytes, and lives as long as `args`. The driver
        // reads the parameter's size from there (a copy made by the launch call, in C), which
        // the compile test checks is the field's.
        let first_byte: &'a u8 = unsafe { &*base.add(field.offset) };
        launch.arg(first_byte);
    }
}

/// Declares a kernel's argument struct: `#[repr(C)]` plain data with its fields' names,
/// offsets and sizes.
macro_rules! kernel_args {
    ($(#[$meta:meta])* $vis:vis struct $name:ident {
        $($(#[$field_meta:meta])* $field:ident: $ty:ty),* $(,)?
    }) => {
        $(#[$meta])*
        #[repr(C)]
        #[derive(Clone, Copy, Debug)]
        $vis struct $name {
            $($(#[$field_meta])* pub $field: $ty),*
        }

        // SAFETY: the fields are the struct's own, their offsets and sizes the compiler's.
        unsafe impl $crate::gpu::args::KernelArgs for $name {
            const FIELDS: &'static [$crate::gpu::args::Field] = &[$($crate::gpu::args::Field {
                name: stringify!($field),
                offset: std::mem::offset_of!($name, $field),
                size: std::mem::size_of::<$ty>(),
            }),*];
        }
    };
}
pub(crate) use kernel_args;

#[cfg(test)]
/// The parameter names of kernel `kernel`'s definition in `source` (a kernel named through a
/// macro, `#define NAME kernel`, is found under the macro), or None where it is not defined.
pub fn param_names(source: &str, kernel: &str) -> Option<Vec<String>> {
    let aliases: Vec<&str> = source
        .lines()
        .filter_map(|line| {
            let mut words = line.trim().strip_prefix("#define ")?.split_whitespace();
            let (alias, value) = (words.next()?, words.next()?);
            (value == kernel && words.next().is_none()).then_some(alias)
        })
        .collect();
    source.split("__global__").skip(1).find_map(|after| {
        // The definition's head: up to its body. Its parameter list is the last parenthesized
        // group (attributes such as __launch_bounds__(...) come before the name).
        let head = &after[..after.find('{')?];
        let open = head.rfind('(')?;
        let name = head[..open].split_whitespace().last()?;
        if name != kernel && !aliases.contains(&name) {
            return None;
        }
        let params = &head[open + 1..head.rfind(')')?];
        let names = params
            .split(',')
            .map(|p| {
                let p = p.trim();
                let start = p
                    .rfind(|c: char| !(c.is_alphanumeric() || c == '_'))
                    .map_or(0, |i| i + 1);
                p[start..].to_string()
            })
            .filter(|n| !n.is_empty())
            .collect();
        Some(names)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    kernel_args! {
        /// A struct with padding between fields, as a kernel's parameters may have.
        struct Example {
            input: u64,
            rows: i32,
            output: u64,
            eps: f32,
        }
    }

    #[test]
    fn fields_are_the_structs_in_order_with_offsets_and_sizes() {
        let got: Vec<_> = Example::FIELDS
            .iter()
            .map(|f| (f.name, f.offset, f.size))
            .collect();
        assert_eq!(
            got,
            [
                ("input", 0, 8),
                ("rows", 8, 4),
                ("output", 16, 8),
                ("eps", 24, 4)
            ]
        );
    }

    #[test]
    fn param_names_are_read_from_the_kernels_definition() {
        let source = r#"
#define TF_FWD silu_fwd
// a declaration-like comment: __global__ void nothing(int a);
extern "C" __global__ void __launch_bounds__(TF_THREADS, 2)
    emb_fwd(const tf_storage* __restrict__ weight, tf_i64 row_stride,
            Strides os, int vectorized) {
  body(weight);
}
extern "C" __global__ void TF_ROW_CTAS __launch_bounds__(128) TF_FWD(const float* x, float* y) {}
"#;
        assert_eq!(
            param_names(source, "emb_fwd"),
            Some(vec![
                "weight".into(),
                "row_stride".into(),
                "os".into(),
                "vectorized".into()
            ])
        );
        assert_eq!(
            param_names(source, "silu_fwd"),
            Some(vec!["x".into(), "y".into()])
        );
        assert_eq!(param_names(source, "missing"), None);
    }
}
