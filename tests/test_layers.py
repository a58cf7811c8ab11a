"""kiln's structure, as a picture: the parts of the compiler and the arrows allowed between them (``ARROWS``);
an import along an arrow not listed fails, so does an import cycle. Also: no module bigger than 600 lines,
the compiler's line budget, no module-level switches, and tests and tools set knobs through options, never
by patching kiln's modules.

Two parts: the compiler (everything under ``kiln/``) and the tools beside it (``kiln_bench/``: bench,
demo, check-ops, the fuzzer, the offline dumps). The tools import kiln through its public API, the few
internals they read listed in ``kiln_bench/_internal.py``; kiln never imports the tools (its command line
names them as data and loads one when its command runs).

Every import counts, at module level or inside a function: a cycle hidden in a function is still a
cycle, and an import along an arrow that is not drawn is still one.
"""
from __future__ import annotations

import ast
import importlib
import inspect
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the parts, in pipeline order; a module belongs to the part of its longest listed prefix
PARTS = {
    "base": ["kiln.compat", "kiln.options", "kiln.config", "kiln.logs", "kiln.debug"],
    "capture": ["kiln.capture"],                                  # decompositions, capture hazards
    "passes": ["kiln.passes", "kiln.pattern_matcher"],            # FX-graph passes
    "partition": ["kiln.partition"],                              # remat under a memory budget
    "loop IR": ["kiln.codegen.ir"],
    "lowering": ["kiln.codegen.lower"],                           # ATen graph -> loop IR
    "scheduling": ["kiln.codegen.schedule"],                      # splits, fusion, kernel plans
    "kernel text": ["kiln.codegen.text"],                         # sources, naming, printer, launchers
    "to_triton": ["kiln.codegen.to_triton"],                      # plan -> Triton text
    "to_cpp": ["kiln.codegen.to_cpp"],                            # plan -> C++ text
    "code generation": ["kiln.codegen"],                          # generate, rewrite, wrapper, fallbacks
    "flex": ["kiln.codegen.flex"],                                # FlexAttention's kernels
    "runtime": ["kiln.runtime"],                                  # builds, binds, launches
    "targets": ["kiln.codegen.target"],                           # one Target per generator
    "compile cache": ["kiln.cache"],
    "pipeline": ["kiln.pipeline", "kiln.repro", "kiln.memory", "kiln.capture.dynamo", "kiln"],
    "command line": ["kiln.cli", "kiln.__main__"],
}

# part -> the other parts its modules may import: data flows FX -> loop IR -> plans -> text -> wrapper ->
# runtime; no emitter imports another; the runtime imports kernel text only (no emitter, no loop IR);
# only a target knows both its emitter and its runtime
ARROWS = {
    "base": set(),
    "capture": {"base"},
    "passes": {"base", "capture"},
    "partition": {"base", "passes"},                              # gc_paused (passes.cse)
    "loop IR": {"base"},
    "lowering": {"base", "loop IR"},
    "scheduling": {"base", "loop IR"},
    "kernel text": {"base", "loop IR", "scheduling"},
    "to_triton": {"base", "loop IR", "scheduling", "kernel text"},
    "to_cpp": {"base", "loop IR", "scheduling", "kernel text"},
    "code generation": {"base", "partition", "loop IR", "lowering", "scheduling", "kernel text"},
    "flex": {"base", "loop IR", "kernel text", "to_triton", "to_cpp", "code generation"},
    "runtime": {"base", "kernel text"},
    "targets": {"base", "capture", "passes", "scheduling", "kernel text", "to_triton", "to_cpp", "code generation",
                "flex", "runtime"},
    "compile cache": {"base", "kernel text", "code generation", "runtime"},
    "pipeline": {"base", "capture", "passes", "partition", "code generation", "targets", "runtime", "compile cache"},
    "command line": {"base", "partition", "runtime", "compile cache", "pipeline"},
}

TOOLS = "kiln_bench"   # the tools' package, beside kiln
# what the tools may take from kiln (None: any name): the public API, the option scope and parser, the
# pipeline's events and log. kiln_bench/_internal.py lists the rest, and only it may import more.
PUBLIC = {"kiln": None, "kiln.config": None, "kiln.debug": {"log", "observe", "counters"}}
INTERNAL = f"{TOOLS}._internal"


def _modules(top="kiln") -> dict:
    """{module name: path} of every module under ``top``."""
    out = {}
    for d, _, files in os.walk(os.path.join(ROOT, top)):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[name[:-len(".__init__")] if name.endswith(".__init__") else name] = path
    return out


def _imports(path: str, modules: dict) -> set:
    """The kiln modules ``path`` imports, anywhere in the file."""
    out = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module:
            subs = {f"{node.module}.{a.name}" for a in node.names} & set(modules)
            out |= subs or ({node.module} & set(modules))
    return out


def _graph(top="kiln"):
    modules = _modules(top)
    return modules, {m: _imports(p, modules) - {m} for m, p in modules.items()}


def part(module: str) -> str:
    best, at = -1, None
    for name, prefixes in PARTS.items():
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, at = len(p), name
    assert at is not None, f"{module} is in no part: add it to PARTS"
    return at


def test_the_picture_is_a_dag_of_listed_parts():
    assert set(ARROWS) == set(PARTS) and all(to <= set(PARTS) for to in ARROWS.values()), "ARROWS names a part PARTS lacks"
    done, active = set(), []

    def visit(p):
        assert p not in active, f"the parts' arrows form a cycle: {active[active.index(p):] + [p]}"
        if p not in done:
            active.append(p)
            for q in ARROWS[p]:
                visit(q)
            active.pop()
            done.add(p)
    for p in PARTS:
        visit(p)


def test_imports_follow_the_arrows():
    _, edges = _graph()
    wrong = [f"{a} ({part(a)}) imports {b} ({part(b)})" for a, bs in sorted(edges.items()) for b in sorted(bs)
             if part(a) != part(b) and part(b) not in ARROWS[part(a)]]
    assert not wrong, "imports along arrows that are not drawn (tests/test_layers.py ARROWS):\n" + "\n".join(wrong)


def test_only_the_targets_test_a_target_by_name():
    """What a target does is asked of its ``codegen.target.Target`` (decompositions, passes, emitter, flags,
    build, cache key): no other module of the compiler compares a value with a target's name."""
    def names(n):
        if isinstance(n, ast.Constant):
            return {n.value} & {"aten", "triton", "cpp"}
        return set().union(*(names(e) for e in n.elts)) if isinstance(n, (ast.Tuple, ast.List, ast.Set)) else set()
    modules, _ = _graph()
    found = [f"{m}:{node.lineno}: {ast.unparse(node)}" for m, p in sorted(modules.items())
             if part(m) not in ("targets", "command line")
             for node in ast.walk(ast.parse(open(p).read())) if isinstance(node, ast.Compare)
             and set().union(names(node.left), *(names(c) for c in node.comparators))]
    assert not found, "target names tested outside codegen/target.py:\n" + "\n".join(found)


def test_no_import_cycles():
    edges = {**_graph()[1], **_graph(TOOLS)[1]}
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):   # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))
    for v in sorted(edges):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_small_modules_and_no_switches():
    modules, tool_modules = _modules(), _modules(TOOLS)
    lines = {m: len(open(p).read().splitlines()) for m, p in {**modules, **tool_modules}.items()}
    assert not [m for m, n in lines.items() if n > 600], {m: n for m, n in lines.items() if n > 600}
    # the compiler (everything under kiln/, its command line included) is what a reader must take in an
    # afternoon; the tools (kiln_bench: bench, check-ops, the fuzzer) are counted apart
    tools = set(tool_modules)
    compiler = sum(n for m, n in lines.items() if m not in tools)
    # 18000 until #20 (kiln/logs.py, Trace.fail, report); 18400 until #21 (pad_mm.mm_rows/mm_cols, row
    # reductions writing into dying inputs, cudagraph._recover); 18475 until passes/empty_mask.py (#21); 18650
    # until pad_mm's in-place column blocks (#21); 18750 until the random-op lowerings of #31. 20000 is the
    # budget for everything (the developers' guide): pay for features by deleting code beyond it
    assert compiler < 20000, compiler
    assert sum(lines[m] for m in tools) < 9000, sum(lines[m] for m in tools)
    switches = [f"{m}: {ln.strip()}" for m, p in {**modules, **tool_modules}.items() for ln in open(p)
                if re.match(r"^[A-Z][A-Z0-9_]* = (True|False)\b", ln)]
    assert not switches, f"module-level switches (make them Options fields): {switches}"


def _kiln_module_names(tree) -> set:
    """Names a file binds to kiln modules (``import kiln.x as y``, ``from kiln.x import module``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("kiln"):
                    names.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kiln"):
            for a in node.names:
                try:
                    obj = getattr(importlib.import_module(node.module), a.name, None)
                except ImportError:
                    obj = None
                if inspect.ismodule(obj) or obj is None and importlib.util.find_spec(f"{node.module}.{a.name}"):
                    names.add(a.asname or a.name)
    return names


def test_nothing_patches_kiln_modules():
    """Tests, benchmarks and tools set knobs through options (``kiln.config.patch``, ``Options``), not
    by setting attributes of kiln's modules."""
    files = [p for d in ("tests", "benchmarks", TOOLS)
             for p in _modules(d).values()]
    found = []
    for path in files:
        tree = ast.parse(open(path).read())
        mods = _kiln_module_names(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and node.args):
                continue
            f = node.func
            setter = (isinstance(f, ast.Attribute) and f.attr == "setattr") or (isinstance(f, ast.Name) and f.id == "setattr")
            target = node.args[0]
            if not setter:
                continue
            if isinstance(target, ast.Name) and target.id in mods or \
                    isinstance(target, ast.Constant) and str(target.value).startswith("kiln"):
                found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}")
        for node in ast.walk(tree):   # module.NAME = value
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id in mods:
                        found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}")
    assert not found, f"kiln modules patched at: {found}"


# -- the two parts: kiln and the tools beside it --------------------------------------------------------
def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _kiln_uses(path: str) -> list:
    """``(line, module, name)`` for each name a file takes from a kiln module: ``from kiln.x import name``,
    and ``mod.name`` read from a name bound to a kiln module (``import kiln``, ``from kiln import debug``).
    Binding a module (``import kiln.x``, ``from kiln import x``) gives ``(line, "kiln.x", None)``."""
    tree = ast.parse(open(path).read())
    uses, bound = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "kiln" or a.name.startswith("kiln."):
                    uses.append((node.lineno, a.name, None))
                    bound[a.asname or "kiln"] = a.name if a.asname else "kiln"
        elif isinstance(node, ast.ImportFrom) and (node.module == "kiln" or (node.module or "").startswith("kiln.")):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                if _is_module(sub):
                    uses.append((node.lineno, sub, None))
                    bound[a.asname or a.name] = sub
                else:
                    uses.append((node.lineno, node.module, a.name))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
            mod, sub = bound[node.value.id], f"{bound[node.value.id]}.{node.attr}"
            uses.append((node.lineno, sub, None) if _is_module(sub) else (node.lineno, mod, node.attr))
    return uses


def _public(module: str, name) -> bool:
    """Whether the tools may take ``name`` from ``module`` (``name`` None: bind the module itself)."""
    if module not in PUBLIC:
        return False
    if name is None or PUBLIC[module] is None and module != "kiln":
        return True
    if module == "kiln":
        import kiln
        return name in kiln.__all__ or name in ("__version__", "__file__")
    return name in PUBLIC[module]


def test_tools_use_kilns_public_api_and_list_the_internals_they_read():
    found = []
    for m, path in sorted(_modules(TOOLS).items()):
        if m == INTERNAL:
            continue
        found += [f"{os.path.relpath(path, ROOT)}:{line} {module}{'.' + name if name else ''}"
                  for line, module, name in _kiln_uses(path) if not _public(module, name)]
    assert not found, ("the tools read kiln internals outside kiln_bench/_internal.py (use the public API, "
                       "or list the internal there):\n" + "\n".join(found))
    internal = {module for _, module, _ in _kiln_uses(_modules(TOOLS)[INTERNAL])}
    assert internal and not internal & set(PUBLIC), internal   # it lists internals only
    assert not _public("kiln.runtime.kernels", "reset") and not _public("kiln.debug", "Trace")   # the rule bites


def test_kiln_never_imports_the_tools():
    """No import of kiln_bench anywhere in kiln (in a function too). The command line names the tools'
    modules as data (``kiln.cli.TOOLS``) and loads one when its command runs; nothing else in kiln names one."""
    found = []
    for m, path in sorted(_modules().items()):
        for node in ast.walk(ast.parse(open(path).read())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{m}:{node.lineno} imports {n}" for n in names if n.split(".")[0] == TOOLS]
            if m != "kiln.cli" and isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                    re.fullmatch(rf"{TOOLS}(\.\w+)*", node.value):
                found.append(f"{m}:{node.lineno} names {node.value}")
    assert not found, found
    from kiln import cli
    assert set(cli.TOOLS) == {"demo", "bench", "check-ops", "bench-compile"}
    for cmd, module in cli.TOOLS.items():
        assert module in _modules(TOOLS) and callable(cli.tool(cmd)), (cmd, module)
