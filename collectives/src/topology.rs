//! Where each rank lives: which node holds it. Hierarchical schedules split traffic into an
//! intra-node part and an inter-node part among ranks of equal local rank ("rails").
//!
//! Invariants:
//! - TOPO-1: node ids are dense, `0..nodes()`, numbered in order of first appearance by rank.
//! - TOPO-2: `ranks_on_node(n)` lists global ranks in increasing order; a rank's local rank is
//!   its index in that list.

/// Placement of ranks on nodes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    node_of: Vec<usize>,
    nodes: Vec<Vec<usize>>,
}

impl Topology {
    /// All `world` ranks on one node.
    pub fn single_node(world: usize) -> Self {
        Self::from_nodes(vec![0; world])
    }

    /// `nodes` nodes with `per_node` ranks each; ranks are numbered node by node.
    ///
    /// ```
    /// use shardline_collectives::topology::Topology;
    /// let t = Topology::uniform(2, 3);
    /// assert_eq!(t.ranks_on_node(1), &[3, 4, 5]);
    /// assert_eq!(t.local_rank(4), 1);
    /// ```
    pub fn uniform(nodes: usize, per_node: usize) -> Self {
        Self::from_nodes((0..nodes * per_node).map(|r| r / per_node.max(1)).collect())
    }

    /// Rank `r` lives on node `node_of[r]`. Ids may be any labels; they are renumbered densely
    /// in order of first appearance (TOPO-1).
    pub fn from_nodes(node_of: Vec<usize>) -> Self {
        let mut labels: Vec<usize> = Vec::new();
        let mut dense = Vec::with_capacity(node_of.len());
        let mut nodes: Vec<Vec<usize>> = Vec::new();
        for (rank, label) in node_of.iter().enumerate() {
            let id = match labels.iter().position(|l| l == label) {
                Some(id) => id,
                None => {
                    labels.push(*label);
                    nodes.push(Vec::new());
                    labels.len() - 1
                }
            };
            dense.push(id);
            nodes[id].push(rank);
        }
        Topology { node_of: dense, nodes }
    }

    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.node_of.len()
    }

    /// Node of rank `r`.
    pub fn node_of(&self, r: usize) -> usize {
        self.node_of[r]
    }

    /// Index of `r` among the ranks of its node (TOPO-2).
    pub fn local_rank(&self, r: usize) -> usize {
        let node = &self.nodes[self.node_of[r]];
        node.iter().position(|&x| x == r).unwrap_or(0)
    }

    /// Number of ranks on `r`'s node.
    pub fn local_world(&self, r: usize) -> usize {
        self.nodes[self.node_of[r]].len()
    }

    /// Number of nodes.
    pub fn nodes(&self) -> usize {
        self.nodes.len()
    }

    /// Global ranks on node `n`, increasing.
    pub fn ranks_on_node(&self, n: usize) -> &[usize] {
        &self.nodes[n]
    }

    /// True when every node holds the same number of ranks (required by hierarchical
    /// schedules; others fall back to the flat ring).
    pub fn is_uniform(&self) -> bool {
        self.nodes.windows(2).all(|w| w[0].len() == w[1].len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn from_nodes_renumbers_densely_topo_1_2() {
        let t = Topology::from_nodes(vec![7, 3, 7, 3, 9]);
        assert_eq!(t.nodes(), 3);
        assert_eq!(t.ranks_on_node(0), &[0, 2]);
        assert_eq!(t.ranks_on_node(1), &[1, 3]);
        assert_eq!(t.local_rank(3), 1);
        assert_eq!(t.local_world(4), 1);
        assert!(!t.is_uniform());
        assert!(Topology::uniform(2, 2).is_uniform());
        assert_eq!(Topology::single_node(3).nodes(), 1);
    }
}
