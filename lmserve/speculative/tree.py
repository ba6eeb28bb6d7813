"""A step's drafts for one sequence: a tree below its newest token (a chain when the width is 1).

The target verifies every node in one forward pass: a node's row attends the cached context, its
ancestors and itself (``AttentionInput.tree_masks``), at the position of its depth. Acceptance
walks down from the newest token: at each node the target's token sampled there picks the child
drafting that token, if any, and the walk stops where none does; the last sample is the token
after the accepted path. The nodes' KV sits in the step's slots in node order, so the accepted
path's KV then moves to the positions of its depths (``KVCache.move``); a path that stays on
nodes ``0, 1, 2, ...`` (the main chain, which drafters put first) needs no move.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# A drafter on the target's hidden states (EAGLE, Medusa) drafts a node's children only while
# the node's path is likely enough by the heads' own probabilities: they track the chance that
# the target accepts the path (EAGLE-2; an EAGLE head trained here: first drafts at p < 0.1
# accepted 6%, 0.3-0.5 30%, 0.7-0.9 77%), and below 0.2 the drafts after it (a head pass each
# for EAGLE) and their verify rows cost more than they are expected to earn. Long fixed lengths
# then stop paying for hopeless depths: EAGLE at the O0 target, k=8, 1.26x plain decoding against
# 0.82x without; Medusa at the default level, k=4, 0.81x against 0.71x at one stream and 0.52x
# against 0.24x at c=16 (chat; performance.md).
MIN_PATH_LOG_PROB = math.log(0.2)


@dataclass
class DraftTree:
    """Node ``i`` drafts ``token_ids[i]`` after node ``parents[i]`` (-1: after the newest token).
    Parents come before their children, and siblings draft different tokens."""

    token_ids: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)

    @classmethod
    def chain(cls, token_ids: list[int]) -> DraftTree:
        return cls(list(token_ids), list(range(-1, len(token_ids) - 1)))

    @classmethod
    def from_candidates(cls, levels: list[list[int]], max_nodes: int) -> DraftTree:
        """A chain of each depth's best candidate (``levels[d][0]`` at depth ``d + 1``) with the
        other candidates as leaves beside it, at most ``max_nodes``: the chain first, then the
        leaves depth by depth."""
        tree = cls.chain([candidates[0] for candidates in levels][:max_nodes])
        for depth, candidates in enumerate(levels):
            for token in candidates[1:]:
                if len(tree) == max_nodes:
                    return tree
                tree.add(depth - 1, token)
        return tree

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def add(self, parent: int, token: int) -> int:
        """The node drafting ``token`` after ``parent``: an existing child, or a new node."""
        for i in range(parent + 1, len(self)):
            if self.parents[i] == parent and self.token_ids[i] == token:
                return i
        self.token_ids.append(token)
        self.parents.append(parent)
        return len(self) - 1

    def path(self, node: int) -> list[int]:
        """The nodes from the newest token's child down to ``node`` (none for -1)."""
        nodes = []
        while node >= 0:
            nodes.append(node)
            node = self.parents[node]
        return nodes[::-1]

    def depth(self, node: int) -> int:
        return len(self.path(node))

    def truncated(self, max_nodes: int, max_depth: int) -> DraftTree:
        """The first ``max_nodes`` nodes at most ``max_depth`` deep (their parents kept)."""
        out, index = DraftTree(), {-1: -1}
        for i, (token, parent) in enumerate(zip(self.token_ids, self.parents)):
            if len(out) == max_nodes:
                break
            if parent in index and self.depth(i) <= max_depth:
                index[i] = len(out)
                out.token_ids.append(token)
                out.parents.append(index[parent])
        return out

    def accept(self, sampled: list[int]) -> list[int]:
        """The accepted nodes, given the target's token sampled at each step token (``sampled[0]``
        after the newest token, ``sampled[i + 1]`` after node ``i``)."""
        path: list[int] = []
        node = -1
        while True:
            child = next((i for i in range(node + 1, len(self))
                          if self.parents[i] == node and self.token_ids[i] == sampled[node + 1]),
                         None)
            if child is None:
                return path
            path.append(child)
            node = child


def num_in_place(path: list[int]) -> int:
    """Leading nodes of an accepted path whose KV is already at the position of their depth."""
    n = 0
    while n < len(path) and path[n] == n:
        n += 1
    return n
