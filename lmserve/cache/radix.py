"""The paged radix-tree prefix cache: KV pages of token prefixes shared between sequences.

The tree is keyed by token ids, one page of tokens per step down an edge, and each node holds the
pages of its part of the key. Only full pages are cached: a sequence's partly filled last page
keeps changing, so it is never shared. A match is therefore page-aligned, and the sequence that
reuses a prefix only ever writes to pages after it: no copy-on-write is needed.

Ownership is the page pool's reference count. The tree holds one reference on every page it
contains; a sequence using a cached prefix holds its own. A page whose only owner is the tree is
evictable, least recently used leaves first. Finished sequences stay recyclable up to
``max_recycled`` of them (None: unbounded here, the engine passes its limit; 0: nothing cached).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Optional, Sequence

from lmserve.cache.pages import PagePool


class RadixNode:
    __slots__ = ("key", "pages", "children", "parent", "last_access")

    def __init__(self, key: tuple[int, ...], pages: list[int], parent: Optional["RadixNode"]):
        self.key = key  # tokens of this edge, len(pages) * page_size of them
        self.pages = pages
        self.children: dict[tuple[int, ...], RadixNode] = {}  # first page of tokens -> child
        self.parent = parent
        self.last_access = 0


class RadixCache:
    """Longest-prefix matching, insertion and LRU eviction over full KV pages."""

    def __init__(self, pool: PagePool, page_size: int, max_recycled: Optional[int] = None) -> None:
        self.pool = pool
        self.page_size = page_size
        self.max_recycled = max_recycled
        self.root = RadixNode((), [], None)
        self.num_pages = 0  # pages the tree holds a reference on
        self._clock = itertools.count(1)
        self._recycled: OrderedDict[int, RadixNode] = OrderedDict()  # id(node) -> end node

    # -- lookup and insertion ------------------------------------------------------------------

    def match(self, tokens: Sequence[int]) -> list[int]:
        """Pages of the longest cached prefix of ``tokens`` (whole pages only).

        The caller takes its own reference on the pages (``pool.share``) if it uses them. An edge
        matched part of the way is split there, so its unmatched tail stays evictable on its own
        while the caller holds the matched part.
        """
        node, pages, _ = self._walk(tokens)
        self._touch(node)
        return pages

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> RadixNode:
        """Cache the full pages of ``tokens`` (held in ``pages``); returns the node at its end.

        Pages of a prefix the tree already holds are left to their owner (the tree keeps its own
        copy); the rest are adopted with one more reference each.
        """
        n = min(len(tokens) // self.page_size, len(pages))
        tokens = tokens[: n * self.page_size]
        node, matched, depth = self._walk(tokens)
        if depth < len(tokens):
            new_pages = list(pages[len(matched) : n])
            child = RadixNode(tuple(tokens[depth:]), new_pages, node)
            node.children[child.key[: self.page_size]] = child
            self.pool.share(new_pages)
            self.num_pages += len(new_pages)
            node = child
        self._touch(node)
        return node

    def recycle(self, tokens: Sequence[int], pages: Sequence[int]) -> None:
        """Keep a finished sequence's full pages for reuse, within the recycling limit."""
        if self.max_recycled == 0:
            return
        end = self.insert(tokens, pages)
        if end is self.root:
            return
        self._recycled.pop(id(end), None)
        self._recycled[id(end)] = end
        while self.max_recycled is not None and len(self._recycled) > self.max_recycled:
            _, oldest = self._recycled.popitem(last=False)
            self._drop_chain(oldest)

    # -- eviction ------------------------------------------------------------------------------

    def evict(self, num_pages: int) -> int:
        """Free at least ``num_pages`` pages if the cache can, least recently used first.

        Only leaves whose pages nobody but the cache holds are evicted. Returns pages freed.
        """
        freed = 0
        while freed < num_pages:
            leaves = [n for n in self._nodes() if not n.children and self._evictable(n)]
            if not leaves:
                break
            freed += self._remove(min(leaves, key=lambda n: n.last_access))
        return freed

    def evictable_pages(self) -> int:
        """Pages held by the cache alone (what ``evict`` could free, eventually)."""
        return sum(1 for n in self._nodes() for p in n.pages if self.pool.refcount(p) == 1)

    def clear(self) -> None:
        """Drop every cached prefix (pages still used by sequences stay theirs)."""
        for node in list(self._nodes()):
            self.pool.release(node.pages)
        self.root.children.clear()
        self._recycled.clear()
        self.num_pages = 0

    # -- internals -----------------------------------------------------------------------------

    def _walk(self, tokens: Sequence[int]) -> tuple[RadixNode, list[int], int]:
        """Follow ``tokens`` down whole pages; split an edge matched only part of the way."""
        ps = self.page_size
        node, depth = self.root, 0
        pages: list[int] = []
        while depth + ps <= len(tokens):
            child = node.children.get(tuple(tokens[depth : depth + ps]))
            if child is None:
                break
            # Whole pages of the child's key that match.
            k = 1
            while (k * ps < len(child.key) and depth + (k + 1) * ps <= len(tokens)
                   and child.key[k * ps : (k + 1) * ps] == tuple(tokens[depth + k * ps : depth + (k + 1) * ps])):
                k += 1
            if k * ps < len(child.key):
                child = self._split(child, k)
            node, pages, depth = child, pages + child.pages, depth + len(child.key)
        return node, pages, depth

    def _split(self, node: RadixNode, k: int) -> RadixNode:
        """Cut ``node`` after its first ``k`` pages; returns the new upper part."""
        ps = self.page_size
        parent = node.parent
        assert parent is not None  # the root is never split: it has no key
        upper = RadixNode(node.key[: k * ps], node.pages[:k], parent)
        upper.last_access = node.last_access
        parent.children[upper.key[:ps]] = upper
        node.key, node.pages, node.parent = node.key[k * ps :], node.pages[k:], upper
        upper.children[node.key[:ps]] = node
        return upper

    def _touch(self, node: RadixNode) -> None:
        now = next(self._clock)
        up: Optional[RadixNode] = node
        while up is not None:
            up.last_access = now
            up = up.parent

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _evictable(self, node: RadixNode) -> bool:
        return all(self.pool.refcount(p) == 1 for p in node.pages)

    def _remove(self, node: RadixNode) -> int:
        assert node.parent is not None  # the root is never removed
        del node.parent.children[node.key[: self.page_size]]
        self._recycled.pop(id(node), None)
        self.pool.release(node.pages)
        self.num_pages -= len(node.pages)
        return len(node.pages)

    def _drop_chain(self, node: RadixNode) -> None:
        """Evict a recycled sequence's own part: from its end up, while nobody else needs it."""
        while (node.parent is not None and not node.children and self._evictable(node)
               and id(node) not in self._recycled):
            parent = node.parent
            self._remove(node)
            node = parent
