"""Include cycles among csrc/engine's files: each X.h and X.cpp are one node (one concept), and
X -> Y where either of X's files includes engine/Y.h. Prints every strongly connected component
of more than one node, with the includes that close it; exits 1 if there is one."""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "csrc"
INCLUDE = re.compile(r'^\s*#\s*include\s+"(engine/[^"]+)\.h"', re.M)


def graph():
    edges = {}
    for path in (ROOT / "engine").rglob("*"):
        if path.suffix not in (".h", ".cpp"):
            continue
        node = str(path.relative_to(ROOT).with_suffix(""))
        targets = edges.setdefault(node, {})
        for target in INCLUDE.findall(path.read_text()):
            if target != node:
                targets.setdefault(target, path.name)
    return edges


def components(edges):
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on.add(node)
        for target in edges.get(node, {}):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            part = []
            while True:
                top = stack.pop()
                on.discard(top)
                part.append(top)
                if top == node:
                    break
            found.append(part)

    sys.setrecursionlimit(10000)
    for node in list(edges):
        if node not in index:
            visit(node)
    return [sorted(part) for part in found if len(part) > 1]


def main():
    edges = graph()
    cycles = components(edges)
    print(f"{len(edges)} nodes, {sum(len(t) for t in edges.values())} include edges, "
          f"{len(cycles)} cycles")
    for part in cycles:
        print("cycle:", ", ".join(part))
        for node in part:
            for target, where in sorted(edges[node].items()):
                if target in part:
                    print(f"  {where} -> {target}.h")
    return 1 if cycles else 0


if __name__ == "__main__":
    sys.exit(main())
