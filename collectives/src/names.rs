//! One table of names for an enum that configs and the command line spell out: its variants
//! in order (`ALL`), each one's name, `Display` and `FromStr` (whose error names the kind of
//! value and lists the names), all from `named_enum!`, so that a name is written once.

/// `named_enum!(Type, "what it is", { Variant => "name", ... })` implements `Type::ALL`,
/// `Type::name`, `Display` and `FromStr` for a fieldless enum.
#[macro_export]
macro_rules! named_enum {
    ($ty:ident, $what:literal, { $($variant:ident => $name:literal),+ $(,)? }) => {
        impl $ty {
            /// Every variant, in the order of its names.
            pub const ALL: [$ty; [$($name),+].len()] = [$($ty::$variant),+];

            /// The variant's name, as configs and the command line write it.
            pub fn name(self) -> &'static str {
                match self {
                    $($ty::$variant => $name),+
                }
            }
        }

        impl ::std::fmt::Display for $ty {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                f.write_str(self.name())
            }
        }

        impl ::std::str::FromStr for $ty {
            type Err = String;
            fn from_str(s: &str) -> Result<$ty, String> {
                $ty::ALL.into_iter().find(|x| x.name() == s).ok_or_else(|| {
                    let names: Vec<&str> = $ty::ALL.iter().map(|x| x.name()).collect();
                    format!(
                        concat!("unknown ", $what, " {:?} (expected one of {})"),
                        s,
                        names.join(", ")
                    )
                })
            }
        }
    };
}
