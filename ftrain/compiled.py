"""``make_step(..., compile=True)``: the step's tensor core as one ``torch.compile`` graph.

The core — forward and backward over the micro-batches (``torch.func.grad_and_value``
around ``functional_call``), the grad-norm metric, ``tx.update`` and the apply — is a pure
function of flat leaf lists, so Dynamo traces it whole: no TensorDict crosses the graph
boundary, and the optimizer's counts and learning rate stay tensors inside it (no
``.item()``). The shell around it stays eager and is cheap: the donated/pinned checks,
cutting the batch, the RNG generator, building the new state and the metrics.

One compiled function per layout (parameter/optimizer/batch paths, batch shapes,
micro-batches, donate): the first call of each compiles — logged once as ``compiled the
step in X s`` and reported as the metric ``compile_s`` of that step — and later calls with
the same shapes never recompile. ``donate=True`` writes the new parameters and optimizer
state into the donated buffers inside the graph, so the compiler can reuse them. The pure
step writes them, inside the graph too, into buffers of the state two steps back that
nothing holds any more (:class:`ftrain.optim.buffers.BufferPool`, states up to
``POOL_BYTES / 2``): no fresh memory a step, so no page faults (MLP 6x1024: ~2,600 a step
before), and the input state stays intact.

Limits: keyed dropout (:class:`ftrain.nn.Dropout` with ``p > 0``) draws from a
``torch.Generator``, which Dynamo does not put in one graph with the rest; such a model
still runs compiled, with the eager step's masks (tested), but not as a single graph.
``dp`` (the collective hook) and the deprecated ``clip=`` are refused.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import tempfile
import time
import types

import torch
from torch._dynamo.exc import BackendCompilerFailed
from torch._dynamo.utils import counters
from torch._inductor.exc import InductorError
from torch.func import functional_call, grad_and_value

from ftrain.grads import Bound, loss_and_aux, merge_aux, train_mode
from ftrain.nn import use_generator
from ftrain.optim.base import pick
from ftrain.optim.buffers import BufferPool, poolable
from ftrain.optim.processing import global_norm_of
from ftrain.state.tree import Key, flatten, rebuild, structure, unflatten
from ftrain.step import carry_frozen
from ftrain.watchdog import compile_started, watch_dynamo_compiles

__all__ = ["AUTO_MIN_STEPS", "CompiledCore", "should_compile"]


watch_dynamo_compiles()  # every Dynamo compile gets the hang watchdog's allowance


# trainer.compile=auto compiles a run of at least this many steps. Measured on a 2-core
# CPU (docs/benchmarks.md, "Step time"): the compiled step saves 6-65 ms a step over the
# eager one and compiles cold in 8-20 s on an idle machine, so it pays after ~210 (MLP
# 6x2048) to ~2,800 (GPT-2 tiny) steps; the margin covers a slower compile.
AUTO_MIN_STEPS = 5_000

# Inductor's C++ wrapper for a CPU step: its kernels launched from C++, not from a Python
# ``call`` (GPT-2 tiny: 14.56 -> 14.13 ms CPU a step, 3-4 %), for a longer cold compile
# (47.8 -> 67.5 s; MLP 6x1024 17.3 -> 20.1 s): it repays the compile after ~50,000 GPT-2
# tiny steps, so it is off unless set (docs/benchmarks.md). A step the C++ wrapper cannot
# emit (torch 2.13: the fp16 loss scale's unscale) is compiled again with Python's.
CPP_WRAPPER = False


@functools.cache
def cxx_compiler_problem() -> str | None:
    """Why Inductor cannot build CPU kernels here (no working C++ compiler), or None. A
    compile without one failed at the first step with a 100-line traceback. Inductor's
    own probe runs only ``$CXX --version``, which a broken toolchain (a wrapper that
    exits 0, a g++ without its headers) passes: a tiny shared library is built too, once
    per process."""
    from torch._inductor import cpp_builder

    try:
        cxx = cpp_builder.get_cpp_compiler()  # probes `$CXX --version` once per process
    except Exception as err:  # InvalidCxxCompiler, or a toolchain probe that broke
        return (str(err).strip().splitlines() or [type(err).__name__])[0]
    return _cannot_build(cxx)


_PROBE_SOURCE = (
    '#include <cmath>\nextern "C" double ftrain_probe(double x) { return std::sqrt(x); }\n'
)


def _cannot_build(cxx: str) -> str | None:
    """Why ``cxx`` cannot build a shared library of C++ with a standard header, or None."""
    with tempfile.TemporaryDirectory(prefix="ftrain-cxx-probe-") as tmp:
        src, lib = os.path.join(tmp, "probe.cpp"), os.path.join(tmp, "probe.so")
        with open(src, "w") as f:
            f.write(_PROBE_SOURCE)
        try:
            done = subprocess.run(
                [cxx, "-shared", "-fPIC", "-O0", "-o", lib, src],
                capture_output=True,
                text=True,
                timeout=120,
            )
        except (OSError, subprocess.TimeoutExpired) as err:
            return f"the C++ compiler {cxx} did not run ({err})"
        if done.returncode != 0 or not os.path.isfile(lib):
            said = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[0][:160]
            return f"the C++ compiler {cxx} cannot build a test library ({said})"
    return None


def should_compile(
    setting: bool | str,
    steps: int,
    world_size: int = 1,
    shard: str = "none",
    device_type: str = "cpu",
) -> tuple[bool, str]:
    """Whether a run compiles its step (``trainer.compile``), and why.

    Args:
        setting: ``True``/``False`` (as given) or ``"auto"``: compile when the run has at
            least :data:`AUTO_MIN_STEPS` steps and its step can be one graph (one rank, an
            unsharded state: ``make_step`` refuses ``compile`` with ``dp`` and ``shard``).
        steps: the run's length (``trainer.max_steps``).
        world_size: ranks of the run.
        shard: ``dist.shard`` as it applies.
        device_type: where the step runs; ``auto`` on a CPU without a working C++
            compiler runs eager (:func:`cxx_compiler_problem`).

    Returns:
        ``(compile, reason)``.

    Example:
        >>> should_compile("auto", 200)
        (False, 'eager: a 200-step run, shorter than the 5,000 steps that repay a compile')
    """
    if setting != "auto":
        return bool(setting), f"trainer.compile={str(bool(setting)).lower()}"
    if world_size > 1 or shard != "none":
        return False, f"eager: a {world_size}-rank, shard={shard} step is not one graph"
    if steps < AUTO_MIN_STEPS:
        return False, (
            f"eager: a {steps:,}-step run, shorter than the {AUTO_MIN_STEPS:,} steps that "
            "repay a compile"
        )
    problem = cxx_compiler_problem() if device_type == "cpu" else None
    if problem:
        return False, f"eager: {problem} (install g++, or point CXX at a C++ compiler)"
    return True, f"compiling the step: a {steps:,}-step run repays the compile"


class CompiledCore:
    """The compiled tensor core of a step (built by ``make_step(..., compile=True)``).

    Attributes:
        compile_seconds: total time spent in calls that compiled (one per layout).
        compiles: how many layouts were compiled.
    """

    def __init__(self, model, loss_fn, update, autocast: torch.dtype | None) -> None:
        self.bound = Bound(model, loss_fn)
        self.update = update
        self.autocast = autocast
        self.cache: dict[tuple, object] = {}
        self.compile_seconds = 0.0
        self.compiles = 0
        self._modules: tuple = ()
        # the pure graph writes its new state into the buffers of the state two steps back
        self.pool = BufferPool()

    def __call__(
        self,
        p,
        b,
        opt,
        micro,
        gen,
        scale,
        in_place: bool,
        keep=None,
        opt_flat=None,
        before_write=None,
    ):
        key, layout, args = self._prepare(
            p, b, opt_flat or structure(opt), micro, scale, in_place, keep
        )
        fn = self.cache.get(key)
        t0, graphs, breaks = time.perf_counter(), _graphs(), _breaks()
        # one graph: it may write the donated buffers anywhere; the mark comes first
        written = _versions(args) if before_write is not None else None
        undo = before_write() if before_write is not None else None
        try:
            with train_mode(self._modules_now()), use_generator(gen):
                # the first call of a layout compiles, inside the call
                first = fn is None
                out = self._first_call(key, (p, b, layout), args) if first else fn(*args)
        except BaseException:
            # a failure while tracing (the user's loss raising on a new layout, a compile
            # error) ran no kernel: the donated state is whole, so the loop's emergency
            # save may still write it. Any in-place write bumps a leaf's version.
            if undo is not None and written is not None and _versions(args) == written:
                undo()
            raise
        new_t, new_b, new_o, loss, norm, aux = out
        compiled = _graphs() != graphs
        if first or compiled:  # a later compile: a guard failed mid-run
            self._report(time.perf_counter() - t0, aux, first, compiled)
            _say_breaks(_graphs() - graphs, _new_breaks(breaks))
        new_p = carry_frozen(p[1], keep, new_t)
        return new_p, new_b, rebuild(layout, new_o), loss, norm, aux

    def _first_call(self, key, parts, args):
        """Compile and run a new layout: with the C++ wrapper first if asked, then Python's
        if it cannot emit a kernel (torch 2.13: the fp16 unscale's list-returning op)."""
        p = parts[0]
        cpp = CPP_WRAPPER and all(t.device.type == "cpu" for t in p[1])
        wrappers = [True, False] if cpp else [False]
        compile_started()  # the hang watchdog allows this wait its first-step allowance
        watch_dynamo_compiles()  # and its recompiles, should a torch._dynamo.reset() intervene
        self._warm_caches(key, p[0], parts[2], args)
        moved: tuple | None = None  # (old, new, made) caches, once compiled in the other
        while True:
            wrapper = wrappers.pop(0)
            fn = self.cache[key] = _compile(self._pure(key, *parts), wrapper)
            try:
                return fn(*args)
            except BaseException as e:
                if wrappers and isinstance(e, InductorError):
                    _note(f"the C++ wrapper failed ({str(e).splitlines()[0][:160]}); Python's")
                    continue
                if moved is None and isinstance(e, _BACKEND):
                    moved = _into_a_fresh_cache(e) or ("", "", False)
                    if moved[0]:
                        wrappers.insert(0, wrapper)
                        continue
                elif moved and moved[0]:  # it failed there too: the old cache was not the cause
                    _back_to_the_cache(*moved)
                # nothing compiled (or the loss raised while tracing): the next call retries
                del self.cache[key]
                note = _note_for(e)
                if note:
                    e.add_note(note)
                raise

    def explain(self, p, b, opt, micro, scale=None, in_place: bool = False, keep=None):
        """``torch._dynamo.explain`` of the core for these inputs (graph count, breaks).

        ``explain`` resets Dynamo, which drops every compiled step and every compile
        callback: the watchdog's is registered again here."""
        key, layout, args = self._prepare(p, b, structure(opt), micro, scale, in_place, keep)
        try:
            with train_mode(self._modules_now()):
                return torch._dynamo.explain(self._pure(key, p, b, layout))(*args)
        finally:
            watch_dynamo_compiles()

    def _prepare(self, p, b, opt_flat, micro, scale, in_place, keep):
        (pkeys, params), (bkeys, buffers) = p, b
        layout, oleaves = opt_flat
        mkeys, first = flatten(micro[0])
        mleaves = [first] + [flatten(mb)[1] for mb in micro[1:]]
        shapes = tuple(tuple(t.shape) for t in first)
        key = (tuple(pkeys), tuple(bkeys), layout, tuple(mkeys), shapes, len(micro), in_place)
        key += (scale is None, None if keep is None else tuple(keep))
        # frozen params enter the graph as inputs that are read, never differentiated
        frozen_idx = [] if keep is None else sorted(set(range(len(params))) - set(keep))
        trained = params if keep is None else pick(keep, params)
        args = (trained, pick(frozen_idx, params), buffers, oleaves, mleaves, scale)
        dst = None if in_place else self._destinations(key, args)
        return key + (dst is None,), layout, args + (dst,)

    def _destinations(self, key, args) -> tuple | None:
        """Where the pure graph writes the new parameters and optimizer leaves (0-d counters
        are made anew): pooled buffers nothing holds any more, or ``None`` (the compiler
        allocates) for a state the pool does not take: too large to keep a spare copy of
        (:data:`POOL_BYTES`), not on the CPU, or of mixed dtypes."""
        trained, oleaves = args[0], args[3]
        big = [t for t in oleaves if t.ndim > 0]
        copy_bytes = sum(t.numel() * t.element_size() for t in (*trained, *big))
        if not (self.pool.admits(copy_bytes) and poolable(trained) and poolable(big)):
            return None
        dst_o = iter(self.pool.destinations((key, "opt"), big))
        targets = [next(dst_o) if t.ndim > 0 else t for t in oleaves]
        return self.pool.destinations((key, "params"), trained), targets

    def _warm_caches(self, key, pkeys, layout, args) -> None:
        """Run ``tx.update`` once on meta tensors (no memory, no kernels) before Dynamo
        traces it: the optimizer's per-structure caches (weight-decay masks, labels) are
        then full, so the graph does not guard on an empty cache and compile a second
        time, unreported, at the next step. An update meta tensors cannot run (a mask
        that reads values) is left to that recompile, which :meth:`_report` names."""
        tkeys = _trained_keys(key, pkeys)
        params, oleaves = ([t.to("meta") for t in ts] for ts in (args[0], args[3]))
        try:
            with torch.no_grad():
                self.update(
                    tkeys, [torch.zeros_like(t) for t in params], rebuild(layout, oleaves), params
                )
        except Exception:  # noqa: BLE001 -- only a cache warm-up; the compile is the judge
            pass

    def _pure(self, key, p, b, layout):
        pkeys = p[0]
        keep = key[8]
        fkeys = [] if keep is None else [k for i, k in enumerate(pkeys) if i not in set(keep)]
        keys = (_trained_keys(key, pkeys), fkeys)
        return _own_code(_core(self, keys, b[0], layout, list(key[3]), key[6]))

    def _modules_now(self) -> tuple:
        mods = tuple(self.bound.modules())[1:]  # the model's, without the Bound wrapper
        if mods != self._modules:
            self._modules = mods
        return self._modules

    def _report(self, seconds: float, aux: dict, first: bool, compiled: bool) -> None:
        self.compile_seconds += seconds
        self.compiles += 1
        aux["compile_s"] = torch.tensor(seconds, dtype=torch.float64)
        if not compiled:  # e.g. TORCHDYNAMO_DISABLE=1, or Dynamo gave up on this frame
            msg = (
                "Dynamo compiled no new graph for this step: it runs eagerly or on graphs "
                "cached for another step (TORCH_LOGS=graph_breaks,recompiles says which)"
            )
        elif first:
            msg = f"compiled the step in {seconds:.1f} s"
        else:
            msg = f"recompiled the step in {seconds:.1f} s (a guard failed: TORCH_LOGS=recompiles names it)"
        print(f"ftrain: {msg}", file=sys.stderr, flush=True)


def _trained_keys(key: tuple, pkeys: list[Key]) -> list[Key]:
    keep = key[8]
    return pkeys if keep is None else pick(list(keep), pkeys)


def _graphs() -> int:
    """How many graphs Dynamo has compiled in this process."""
    return counters["stats"]["unique_graphs"]


def _breaks() -> dict[str, int]:
    """Dynamo's graph breaks so far in this process, by reason."""
    return dict(counters["graph_break"])


def _new_breaks(before: dict[str, int]) -> list[str]:
    return [r for r, n in counters["graph_break"].items() if n > before.get(r, 0)]


# errors of the first compiled call that are not the loss's tracing: no note for them
_NOT_TRACING = (MemoryError, torch.OutOfMemoryError)
# the backend failed building what was traced (Inductor's own, or wrapped by Dynamo)
_BACKEND = (InductorError, BackendCompilerFailed)

_BACKEND_NOTE = (
    "ftrain: the compiler (Inductor) failed building the step. Where its cache held files, "
    "a new empty cache was tried too (said above), so a damaged cache is ruled out unless "
    "none could be made: then remove the cache directory (TORCHINDUCTOR_CACHE_DIR; by "
    "default /tmp/torchinductor_<user>) and run again. Otherwise run eagerly with "
    "trainer.compile=false"
)


def _into_a_fresh_cache(e: BaseException) -> tuple[str, str, bool] | None:
    """After the backend failed with files in its cache: point Inductor at the cache
    directory ``DIR.fresh`` beside it (said; empty the first time, reused by later starts),
    so the caller compiles once more; returns ``(old, new, made)``. A cache damaged by a
    disk that filled or a kill mid-write (truncated ``.py``/``.so`` files, which Inductor
    reuses by name) failed every start, and a supervisor's restarts with it; a failure the
    cache did not cause fails again there (:func:`_back_to_the_cache` undoes the move)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    from torch._inductor.utils import clear_caches

    try:
        old = cache_dir()
        if not any(os.scandir(old)):  # nothing cached: the cache is not the cause
            return None
        # one name, reused: a supervisor's restarts each made a cold cache of its own
        new = old.rstrip(os.sep) + ".fresh"
        made = not os.path.lexists(new)
        os.makedirs(new, exist_ok=True)
    except OSError:
        return None
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = new
    clear_caches()  # the in-memory ones point into the old directory
    _note(
        f"it failed with the compile cache at {old} ({_first_line(e)}); compiling once more "
        f"in the cache at {new}. If this compiles, {old} is damaged (a disk that filled, a "
        "kill mid-write): remove it (or set TORCHINDUCTOR_CACHE_DIR to the other one)"
    )
    return old, new, made


def _back_to_the_cache(old: str, new: str, made: bool) -> None:
    """The step failed in the other cache too: the old one was not the cause. Inductor
    goes back to it (this process's later compiles stay warm); the other one goes if this
    attempt made it."""
    import shutil

    from torch._inductor.utils import clear_caches

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = old
    clear_caches()
    if made:
        shutil.rmtree(new, ignore_errors=True)
    _note(f"it failed in {new} too: back to {old} (the cache is not the cause)")


def _first_line(e: BaseException) -> str:
    """The last line of the backend's message that names the cause (Dynamo puts its own
    'backend=... raised:' line first)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    cause = next((ln for ln in lines if "raised:" not in ln), lines[0] if lines else repr(e))
    return cause[:160]


def _note_for(e: BaseException) -> str | None:
    """What ftrain adds to an error of the step's first compiled call: a damaged compile
    cache failed every start with the tracing note, which blamed the user's loss."""
    if isinstance(e, _BACKEND):
        return _BACKEND_NOTE
    if isinstance(e, Exception) and not isinstance(e, _NOT_TRACING):
        return _TRACING_NOTE
    return None


# added to an error of the first compiled call: an error from the loss while it is traced
# read like a torch bug ("Cannot access data pointer of Tensor that doesn't have storage")
_TRACING_NOTE = (
    "ftrain: this came from the step's first compiled call (trainer.compile / "
    "make_step(compile=True)), which traces the loss with fake tensors under torch.func: code "
    "that leaves torch (.numpy(), .tolist(), a NumPy or Python computation on tensor values) "
    "cannot be traced; keep the loss in torch ops, or run without compile to see if it "
    "trains eagerly"
)


def _say_breaks(graphs: int, reasons: list[str]) -> None:
    """A step compiled in pieces (a graph break: a ``print`` or a ``.item()`` branch in the
    loss) runs what lies between them eagerly, the forward and backward often: the step
    said "compiled" all the same, a silent loss of most of what compiling buys."""
    if graphs <= 1 and not reasons:
        return
    why = reasons[0].splitlines()[0][:160] if reasons else "reason not recorded"
    more = f" (and {len(reasons) - 1} more)" if len(reasons) > 1 else ""
    print(
        f"ftrain: warning: the step compiled as {max(graphs, 2)} graphs, not one: a graph "
        f"break ({why}){more} runs the code between them eagerly; TORCH_LOGS=graph_breaks "
        "names the line (remove prints and .item() branches from the loss)",
        file=sys.stderr,
        flush=True,
    )


def _own_code(fn):
    """``fn`` with a code object of its own. Dynamo keeps compiled graphs, and counts
    recompiles against its limit (8), per code object; every core is the same nested
    function, so a sweep's ninth compiled job (or layout) would silently run eager."""
    code = fn.__code__.replace()
    return types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _versions(args) -> int | None:
    """The version counter of the first trained parameter: unchanged after a failure means
    the donated call wrote nothing. One leaf tells: the graph's in-place writes begin with
    every parameter at once (AOTAutograd bumps each mutated input before its first kernel;
    eagerly, one ``_foreach_add_`` over the params comes first), and reading all ~160 leaves
    of GPT-2 tiny cost 27 us a step. ``None`` for an inference tensor, which keeps no
    counter (such a state stays marked after a failure)."""
    first = args[0][0] if args[0] else None
    return None if first is None or first.is_inference() else first._version


def _compile(core, cpp_wrapper: bool):
    """``torch.compile`` of the step's core (with Inductor's C++ wrapper: a CPU step with
    :data:`CPP_WRAPPER` on)."""
    return torch.compile(core, dynamic=False, options={"cpp_wrapper": cpp_wrapper})


def _note(msg: str) -> None:
    print(f"ftrain: compiling the step: {msg}", file=sys.stderr, flush=True)


def _core(cc: CompiledCore, keys: tuple, bkeys: list[Key], layout, mkeys, in_place: bool):
    """The pure function Dynamo traces: flat leaves in, flat leaves and metrics out.

    ``keys`` is ``(trainable paths, frozen paths)``; only the trainable are differentiated.
    """
    pkeys, fkeys = keys
    pnames = ["model." + ".".join(k) for k in pkeys]
    fnames = ["model." + ".".join(k) for k in fkeys]
    bnames = ["model." + ".".join(k) for k in bkeys]
    bound, update, autocast = cc.bound, cc.update, cc.autocast

    def core(params, frozen, buffers, oleaves, micro, scale, dst=None):
        buffers = [t.clone() for t in buffers]  # a forward may update buffers in place
        k = len(micro)
        constant = dict(zip(fnames, frozen, strict=True))

        # the buffers are an input of the transformed function, not captured: a forward
        # that updates them in place (BatchNorm's running stats) may only write its inputs
        def loss_of(ps, bs, mb):
            named = dict(zip(pnames, ps, strict=True)) | constant
            named |= dict(zip(bnames, bs, strict=True))
            device = ps[0].device.type
            with torch.autocast(device, dtype=autocast or torch.float32, enabled=bool(autocast)):
                out = functional_call(bound, named, (mb,), tie_weights=True, strict=False)
            loss, aux = loss_and_aux(out)
            scaled = loss / k if scale is None else loss * (scale / k)
            return scaled, (loss.detach().float(), aux)

        grads, loss_sum, aux_total = None, None, {}
        for leaves in micro:
            batch = unflatten(mkeys, leaves)
            g, (_, (loss, aux)) = grad_and_value(loss_of, has_aux=True)(params, buffers, batch)
            grads = list(g) if grads is None else torch._foreach_add(grads, list(g))
            loss_sum = loss if loss_sum is None else loss_sum + loss
            merge_aux(aux_total, aux, k)
        norm = global_norm_of(grads)
        norm = norm if scale is None else norm / scale
        updates, new_opt = update(pkeys, grads, rebuild(layout, oleaves), params)
        new_layout, new_o = structure(new_opt)
        if new_layout != layout:
            raise ValueError("compile=True needs an optimizer whose state keeps its layout")
        if in_place:  # donation: the compiler writes the results into the donated buffers
            torch._foreach_add_(params, updates)
            return params, buffers, _donate(oleaves, new_o), loss_sum / k, norm, aux_total
        if dst is not None:  # pooled: the same writes, into buffers no state holds any more
            dst_p, dst_o = dst
            torch._foreach_copy_(dst_p, torch._foreach_add(params, updates))
            return dst_p, buffers, _donate(dst_o, new_o), loss_sum / k, norm, aux_total
        return torch._foreach_add(params, updates), buffers, new_o, loss_sum / k, norm, aux_total

    return core


def _donate(old: list[torch.Tensor], new: list[torch.Tensor]) -> list[torch.Tensor]:
    """Write the new optimizer leaves into the donated ones, except 0-d counters: they are
    free to make anew, and inductor (torch 2.13, CPU) ran a written-back count's copy before
    the schedule read the old value, so the learning rate came out one step ahead."""
    big = [i for i, t in enumerate(old) if t.ndim > 0]
    if big:
        torch._foreach_copy_([old[i] for i in big], [new[i] for i in big])
    return [old[i] if old[i].ndim > 0 else new[i] for i in range(len(old))]
