"""Global prefix identification for offline batches (BatchLLM, sections 3.2 and 3.3.2).

An offline batch is known whole before it runs, so instead of hoping an LRU prefix cache keeps shared
blocks alive, we find the shared prefixes ahead of time: a compact prefix (radix) tree over every
prompt's token ids, then BatchLLM's Algorithm 1, which enlarges first-level prefixes by forking a
child and merging it with a grandchild when the grandchild's sharing is worth more than recomputing
the child. Each child of the root is then one prefix-sharing group; the scheduler computes its prefix
once and holds it while the group runs. Pure Python on token ids (no torch), so it is unit-tested
directly and costs nothing next to the model.

Token saving (BatchLLM Eq. 1): 1 - processed prefill tokens / logical prefill tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(eq=False, slots=True)
class PrefixNode:
    """A run of tokens shared by every prompt below it (root: no tokens)."""

    tokens: list[int]
    children: list[PrefixNode] = field(default_factory=list)
    requests: list[int] = field(default_factory=list)  # prompts that end exactly at this node
    leaves: int = 0  # prompts in this subtree (kept current by build and enlarge)


@dataclass(slots=True)
class PrefixGroup:
    """Requests that share one first-level prefix; the unit the offline scheduler runs."""

    prefix: list[int]
    members: list[int]  # prompt indices, in input order
    distinct_tokens: int  # sum over members of (prompt length - prefix length)

    @property
    def prefill_tokens(self) -> int:
        """Tokens this group computes: its prefix once, then every member's distinct part."""
        return len(self.prefix) + self.distinct_tokens


def build_tree(prompts: Sequence[Sequence[int]]) -> PrefixNode:
    """The compact prefix tree of ``prompts`` (a node with one child and no prompt ending is merged)."""
    order = sorted(range(len(prompts)), key=lambda i: tuple(prompts[i]))
    root = PrefixNode(tokens=[], leaves=len(prompts))
    # Work items: (parent, prompt indices in sorted order, depth already covered by the parent).
    stack: list[tuple[PrefixNode, list[int], int]] = [(root, order, 0)]
    while stack:
        parent, idx, depth = stack.pop()
        run: list[int] = []
        for i in idx:
            if len(prompts[i]) == depth:
                parent.requests.append(i)
                continue
            if run and prompts[run[0]][depth] != prompts[i][depth]:
                stack.append(_child(parent, prompts, run, depth))
                run = []
            run.append(i)
        if run:
            stack.append(_child(parent, prompts, run, depth))
    return root


def _child(
    parent: PrefixNode, prompts: Sequence[Sequence[int]], run: list[int], depth: int
) -> tuple[PrefixNode, list[int], int]:
    """Add the node for ``run`` (sorted prompts that agree at ``depth``) under ``parent``."""
    first, last = prompts[run[0]], prompts[run[-1]]
    end = depth
    limit = min(len(first), len(last))
    while end < limit and first[end] == last[end]:  # sorted: LCP of the run = LCP(first, last)
        end += 1
    node = PrefixNode(tokens=list(first[depth:end]), leaves=len(run))
    parent.children.append(node)
    return node, run, end


def _post_order(root: PrefixNode) -> list[PrefixNode]:
    out: list[PrefixNode] = []
    stack = [root]
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children)
    out.reverse()  # every node after all of its descendants
    return out


def enlarge_first_level(root: PrefixNode) -> PrefixNode:
    """BatchLLM Algorithm 1, in place: fork a child and merge it with a grandchild whenever the
    grandchild's first-level sharing, (leaves - 1) x its tokens, beats recomputing the child's tokens.

    Children are solved before their parent (post-order), as the recursion in the paper does."""
    for node in _post_order(root):
        for child in list(node.children):
            for gchild in list(child.children):
                gain = (gchild.leaves - 1) * len(gchild.tokens)
                if gain > len(child.tokens):
                    merged = PrefixNode(
                        tokens=child.tokens + gchild.tokens,
                        children=gchild.children,
                        requests=gchild.requests,
                        leaves=gchild.leaves,
                    )
                    node.children.append(merged)
                    child.children.remove(gchild)
                    child.leaves -= gchild.leaves
            if not child.children and not child.requests:
                node.children.remove(child)
    return root


def first_level_groups(root: PrefixNode) -> list[PrefixGroup]:
    """One group per child of the root: its tokens are the group's prefix; all prompts below join."""
    groups = []
    for child in root.children:
        members: list[int] = []
        distinct = 0
        stack = [(node, 0) for node in child.children]
        members.extend(child.requests)
        while stack:
            node, above = stack.pop()
            length = above + len(node.tokens)
            members.extend(node.requests)
            distinct += length * len(node.requests)
            stack.extend((c, length) for c in node.children)
        group = PrefixGroup(prefix=list(child.tokens), members=sorted(members), distinct_tokens=distinct)
        groups.append(group)
    groups.extend(PrefixGroup(prefix=[], members=[i], distinct_tokens=0) for i in root.requests)
    return groups


def tree_tokens(root: PrefixNode) -> int:
    """Prefill tokens with every level of the tree shared (each node computed once): the optimum."""
    return sum(len(n.tokens) for n in _post_order(root))


def first_level_optimum(root: PrefixNode) -> int:
    """The most prefill tokens any one-level grouping can save (exact; for analysis and tests).

    A grouping picks anchor nodes; each prompt joins its deepest anchor ancestor, and an anchor at
    depth d with m members saves (m - 1) x d. ``best[(v, d)]`` = the most saved in v's subtree when
    the nearest anchor above v sits at depth d, for each ancestor depth d of v."""
    ancestors: dict[int, list[int]] = {id(root): []}  # depths of a node's proper ancestors
    depth: dict[int, int] = {id(root): 0}
    for node in reversed(_post_order(root)):  # parents before children
        for c in node.children:
            depth[id(c)] = depth[id(node)] + len(c.tokens)
            ancestors[id(c)] = [*ancestors[id(node)], depth[id(node)]]
    best: dict[tuple[int, int], int] = {}
    for node in _post_order(root):
        dv = depth[id(node)]
        anchored = sum(best[(id(c), dv)] for c in node.children) + dv * (len(node.requests) - 1)
        for d in ancestors[id(node)] or [0]:
            free = sum(best[(id(c), d)] for c in node.children) + d * len(node.requests)
            best[(id(node), d)] = max(free, anchored)
    return best[(id(root), 0)]


def saving_ratio(processed: int, logical: int) -> float:
    """BatchLLM Eq. 1: the share of logical prefill tokens that sharing avoids computing."""
    return 0.0 if logical == 0 else 1.0 - processed / logical


def order_groups(groups: list[PrefixGroup], decode_lengths: Sequence[int] | None = None) -> list[PrefixGroup]:
    """BatchLLM Eq. 3: groups with more decoding per prefill token first (R_group = decode / prefill).

    With equal decode budgets this is R_group = 1 / (L_prefix + sum L_distinct): short groups first,
    so the long prompts that come later mix with the decode tokens of those already running."""

    def ratio(g: PrefixGroup) -> float:
        decode = 1.0 if decode_lengths is None else sum(decode_lengths[i] for i in g.members) / len(g.members)
        return decode / max(1, len(g.prefix) + g.distinct_tokens)

    return sorted(groups, key=lambda g: (-ratio(g), g.members[0]))
