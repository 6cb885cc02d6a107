//! Model specifications: what a model's parameters are called and how they group into units
//! (the FSDP wrapping granularity). Building a spec allocates no parameter memory.

use serde::{Deserialize, Serialize};

/// One named tensor of a unit (a trainable parameter or a replicated buffer).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamSpec {
    /// Stable name, e.g. `blocks.0.linear.weight`.
    pub name: String,
    /// Shape, row-major.
    pub shape: Vec<usize>,
}

impl ParamSpec {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// A unit: a group of layers whose parameters are flattened, sharded and gathered together.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnitSpec {
    /// Unit name, e.g. `blocks.0`.
    pub name: String,
    /// Trainable parameters in flat-buffer order.
    pub params: Vec<ParamSpec>,
    /// Non-trainable state (BatchNorm running mean/var), replicated on every rank.
    pub buffers: Vec<ParamSpec>,
}

impl UnitSpec {
    /// Total trainable elements of the unit (before padding).
    pub fn numel(&self) -> usize {
        self.params.iter().map(ParamSpec::numel).sum()
    }
    /// Total replicated-buffer elements of the unit.
    pub fn buffer_numel(&self) -> usize {
        self.buffers.iter().map(ParamSpec::numel).sum()
    }
}

/// A model's units in execution order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelSpec {
    /// Zoo name, e.g. `mlp-bn`.
    pub name: String,
    /// Units in forward order.
    pub units: Vec<UnitSpec>,
}

impl ModelSpec {
    /// Total trainable elements.
    pub fn numel(&self) -> usize {
        self.units.iter().map(UnitSpec::numel).sum()
    }

    /// The first way `other` differs from `self`, in words that say which is which (`self`
    /// "here", `other` "there"), or `None` when they are equal: the name, the number of units,
    /// then unit by unit its name, its parameters' and buffers' count, names and shapes.
    pub fn first_difference(&self, other: &ModelSpec) -> Option<String> {
        if self.name != other.name {
            return Some(format!("model '{}' there, '{}' here", other.name, self.name));
        }
        if self.units.len() != other.units.len() {
            return Some(format!("{} units there, {} here", other.units.len(), self.units.len()));
        }
        for (a, b) in self.units.iter().zip(&other.units) {
            if a.name != b.name {
                return Some(format!("unit '{}' there, '{}' here", b.name, a.name));
            }
            for (what, pa, pb) in
                [("parameters", &a.params, &b.params), ("buffers", &a.buffers, &b.buffers)]
            {
                if pa.len() != pb.len() {
                    return Some(format!(
                        "unit '{}' has {} {what} there, {} here",
                        a.name,
                        pb.len(),
                        pa.len()
                    ));
                }
                for (x, y) in pa.iter().zip(pb) {
                    if x.name != y.name {
                        return Some(format!("'{}' there, '{}' here", y.name, x.name));
                    }
                    if x.shape != y.shape {
                        return Some(format!(
                            "'{}' is {:?} there, {:?} here",
                            x.name, y.shape, x.shape
                        ));
                    }
                }
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> ModelSpec {
        let p = |name: &str, shape: &[usize]| ParamSpec { name: name.into(), shape: shape.into() };
        ModelSpec {
            name: "m".into(),
            units: vec![
                UnitSpec { name: "a".into(), params: vec![p("a.w", &[2, 3])], buffers: vec![] },
                UnitSpec {
                    name: "b".into(),
                    params: vec![p("b.w", &[3, 4]), p("b.b", &[4])],
                    buffers: vec![p("b.mean", &[4])],
                },
            ],
        }
    }

    /// Every kind of difference is found and named, with the two sides the right way round.
    #[test]
    fn the_first_difference_is_named() {
        let here = spec();
        assert_eq!(here.first_difference(&here.clone()), None);
        let there = |f: &dyn Fn(&mut ModelSpec)| {
            let mut s = spec();
            f(&mut s);
            here.first_difference(&s).expect("a difference")
        };
        assert_eq!(there(&|s| s.name = "n".into()), "model 'n' there, 'm' here");
        assert_eq!(
            there(&|s| {
                s.units.pop();
            }),
            "1 units there, 2 here"
        );
        assert_eq!(there(&|s| s.units[1].name = "c".into()), "unit 'c' there, 'b' here");
        assert_eq!(
            there(&|s| {
                s.units[1].params.pop();
            }),
            "unit 'b' has 1 parameters there, 2 here"
        );
        assert_eq!(there(&|s| s.units[1].params[1].name = "b.x".into()), "'b.x' there, 'b.b' here");
        assert_eq!(
            there(&|s| s.units[1].params[0].shape = vec![3, 8]),
            "'b.w' is [3, 8] there, [3, 4] here"
        );
        assert_eq!(
            there(&|s| s.units[1].buffers[0].shape = vec![5]),
            "'b.mean' is [5] there, [4] here"
        );
    }
}
