"""Which rules of a parsed xgrammar Grammar can ever end: the standard "productive symbols"
fixpoint over the grammar's own rules (those of an EBNF grammar, or of the grammar xgrammar
builds for a JSON schema or a regex). A grammar whose root is not productive matches no finite
text (`root ::= root`, `root ::= "x" root`, a schema whose required property is a `$ref` back to
itself): xgrammar accepts it, and its matcher then allows no token at all, or only ever more of
them, so the engine refuses it before generating anything.

It reads the grammar through `Grammar.serialize_json()` (rules, and the expressions in CSR form:
`[type, data length, data...]`, types as in xgrammar's grammar_impl.h). An expression type it
does not know counts as productive, so a newer xgrammar can make the check miss a case, never
refuse a grammar that can end.
"""

from __future__ import annotations

import json
from typing import Any

# xgrammar's GrammarExprType values (grammar_impl.h) that can fail to end; the others (byte
# strings 0, character classes 1-2, empty 3, tag dispatch 7, any added later) always can.
_RULE_REF, _SEQUENCE, _CHOICES, _REPEAT = 4, 5, 6, 8


def never_ending_rules(grammar: Any) -> list[str]:
    """When the root derives no finite string: the rules that derive none (root first), the
    cycle to break. Else (or when the serialized form is not the one this reads) []."""
    try:
        data = json.loads(grammar.serialize_json())
        rules: list[list[Any]] = data["rules"]
        exprs: list[int] = data["grammar_expr_data"]
        starts: list[int] = data["grammar_expr_indptr"]
        root: int = data["root_rule_id"]
        bodies = [int(rule[1]) for rule in rules]
        names = [str(rule[0]) for rule in rules]
    except (AttributeError, KeyError, IndexError, TypeError, ValueError):
        return []
    if len(starts) > len(exprs) or not 0 <= root < len(rules):
        return []  # the two CSR arrays the other way round, or not a grammar we read
    productive = [False] * len(rules)

    def expr(expr_id: int) -> tuple[int, list[int]]:
        start = starts[expr_id]
        return exprs[start], exprs[start + 2:start + 2 + exprs[start + 1]]

    def ends(expr_id: int, depth: int = 0) -> bool:
        """Whether the expression derives a finite string, given the rules known productive."""
        kind, args = expr(expr_id)
        if depth > 64:  # expressions nest a few levels only: not a format we know
            return True
        if kind == _RULE_REF:
            return productive[args[0]]
        if kind == _SEQUENCE:
            return all(ends(e, depth + 1) for e in args)
        if kind == _CHOICES:
            return any(ends(e, depth + 1) for e in args)
        if kind == _REPEAT:  # [rule, min, max]: zero repetitions end at once
            return args[1] == 0 or productive[args[0]]
        return True  # strings, character classes, empty, tag dispatch, types added later

    def referenced(expr_id: int, depth: int = 0) -> set[int]:
        kind, args = expr(expr_id)
        if kind in (_RULE_REF, _REPEAT):
            return {args[0]}
        if kind in (_SEQUENCE, _CHOICES) and depth <= 64:
            return set().union(*(referenced(e, depth + 1) for e in args))
        return set()

    try:  # a worklist: a rule is looked at again only when a rule it refers to became productive
        users: list[list[int]] = [[] for _ in rules]
        for rule_id, body in enumerate(bodies):
            for used in referenced(body):
                users[used].append(rule_id)
        work = list(range(len(rules)))
        while work:
            rule_id = work.pop()
            if not productive[rule_id] and ends(bodies[rule_id]):
                productive[rule_id] = True
                work.extend(users[rule_id])
    except (IndexError, TypeError):
        return []
    if productive[root]:
        return []
    dead = [root] + [r for r in range(len(rules)) if not productive[r] and r != root]
    return [names[r] for r in dead]
