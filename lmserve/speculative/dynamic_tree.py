"""EAGLE-2's dynamic draft tree: grow the tree where the drafter is confident, keep its best nodes.

A node's value is its path's probability under the drafter (the product of the draft
probabilities from the newest token down to it), which tracks the chance that the target accepts
the whole path (the EAGLE-2 paper). Drafting expands, at each depth, the ``width`` most valuable
nodes of that depth with their ``width`` best tokens each; the tree verified is then the
``max_nodes`` most valuable nodes drafted at any depth. A node is never worth more than its
parent, so that set holds every node's ancestors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lmserve.speculative.tree import DraftTree


@dataclass
class CandidateTree:
    """Every node drafted so far: node ``i`` drafts ``token_ids[i]`` after ``parents[i]`` (-1:
    after the newest token), with path log-probability ``values[i]``, ``depths[i]`` deep."""

    token_ids: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)

    def add_children(self, parent: int, token_ids: list[int], log_probs: list[float]) -> None:
        """The drafter's best tokens after ``parent`` (distinct), with their log-probabilities."""
        base = self.values[parent] if parent >= 0 else 0.0
        depth = self.depths[parent] + 1 if parent >= 0 else 1
        for token, log_prob in zip(token_ids, log_probs):
            self.token_ids.append(token)
            self.parents.append(parent)
            self.values.append(base + log_prob)
            self.depths.append(depth)

    def best(self, nodes: list[int], n: int) -> list[int]:
        """The ``n`` most valuable of ``nodes``; a tie goes to the shallower, then the earlier."""
        return sorted(nodes, key=lambda i: (-self.values[i], self.depths[i], i))[:n]

    def frontier(self, depth: int, width: int) -> list[int]:
        """The nodes ``depth`` deep to expand next: the ``width`` most valuable."""
        return self.best([i for i, d in enumerate(self.depths) if d == depth], width)

    def select(self, max_nodes: int) -> DraftTree:
        """The ``max_nodes`` most valuable nodes as a ``DraftTree``: first the chain that follows
        the most valuable child from the newest token down (verified in place when accepted,
        see ``tree``), then the others depth by depth."""
        kept = set(self.best(list(range(len(self.token_ids))), max_nodes))
        chain, node = [], -1
        while children := [i for i in kept if self.parents[i] == node]:
            node = self.best(children, 1)[0]
            chain.append(node)
        order = chain + sorted(kept - set(chain), key=lambda i: (self.depths[i], i))
        index = {-1: -1} | {node: i for i, node in enumerate(order)}
        return DraftTree([self.token_ids[i] for i in order], [index[self.parents[i]] for i in order])
