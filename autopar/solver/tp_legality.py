"""Which tensor-parallel splits of a layer can run, decided before they are priced.

The operator-wise ILP (`intra_op`) splits any GEMM that reads a parameter; torch's parallel
styles then run the model's own code on each rank's share. That code is not always written
for a share, and a split it cannot run either crashes at run time or silently computes
something else. The rules, each naming the op or module that decided it:

- *module class*: a module is split when its forward computes an affine map of its input on
  its own weight and bias (``nn.Linear``; GPT-2's ``Conv1D``, weight stored ``(in, out)``;
  ``FalconLinear``), recognised by running it on random values (`autopar.trace.linear_like`),
  or is a plain ``nn.Embedding``; a GEMM of another module (``nn.MultiheadAttention``'s packed
  projection, a convolution, BLOOM's attention scores read beside its ALiBi table) runs
  replicated, and so does an embedding subclass with a forward of its own (OPT's learned
  positional embedding).
- *fused output cut along the split dim* (read from the traced graph): a projection whose
  output is sliced, split or indexed along the dimension a column split shards (Phi-3's
  ``qkv_proj`` and ``gate_up_proj``, nanoGPT's ``c_attn.split``, Falcon's fused query/key/value)
  would hand each rank a contiguous block of the fused matrix, not its share of each part,
  unless the cuts are read as parts (autopar.solver.tp_fused: the projection then splits as its
  parts). An op that drops a dim counts as a cut of the split dim unless the shapes say it
  dropped another: BLOOM's per-head interleaved ``query_key_value`` is cut along its ``3``
  after a view into heads, which a split by heads keeps whole.
- *joined output along the split dim* (read from the traced graph): a projection whose output is
  concatenated along the dimension a column split shards (``torch.cat([self.up1(x),
  self.up2(x)], -1)`` before a down projection) would join each rank's shares of the parts, which
  a row split after it reads as its share of the whole: it trains something else and no shape
  says so, so the projection runs replicated.
- *local shapes* (a probe on fake tensors): each paired region (a module whose linear children
  are split column- then row-wise) is run with its linears narrowed to one rank's share; code
  that reshapes by a hard-coded head count (StableLM's ``view(bsz, q_len, self.num_heads, ...)``)
  fails there, and so does code that folds the sequence instead (OPT's
  ``view(bsz, -1, self.num_heads, d)``: an op whose output lost part of the sequence length);
  the region's linears run replicated instead, unless the region runs with its activations kept
  as DTensors, as the generated code then runs it (autopar.solver.tp_global_shapes): global
  sizes stay global there, and such a region is split and listed in ``dtensor_regions``. A
  key/value projection computing its group's head (``kv_group``, autopar.solver.tp_kv_groups)
  is narrowed to one head's rows: attention that repeats key/value heads by a count it holds
  (Hugging Face's ``repeat_kv(k, self.num_key_value_groups)``) or views by a head count it holds
  (StableLM's ``num_heads``, ``num_key_value_heads``) fails there, unless integer attributes of
  the region holding those counts, set to one rank's counts, make it run: the probe finds them by
  value, fewest first, and the set that works is set in the generated code
  (``region_attributes``). Such a region runs on local tensors only.

A rule that cannot be checked (no model file to build) is skipped, never guessed.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from cost_models.weights import parameter_derived
from autopar.solver.tp_kv_groups import KVGroups, kv_groups
from cost_models.tp_layout import pairs

if TYPE_CHECKING:
    from torch import nn

    from autopar.model_profile import ModelProfile, OpProfile

# Ops that cut a tensor along a dimension (their output is smaller there than their input).
_CUTTING = ("aten.slice.", "aten.split.", "aten.split_with_sizes.", "aten.chunk.", "aten.narrow.",
            "aten.select.", "aten.index.", "aten.unbind.", "aten.index_select.")
_RESHAPING = ("aten.view.", "aten._unsafe_view.", "aten.reshape.")
_JOINING = ("aten.cat.",)


@dataclass(frozen=True)
class IllegalSplit:
    """A module the ILP must replicate, and why (one line for the report).

    Attributes:
        module: the module's FQN (in the layer the ILP solves).
        kind: the rule that decided it (``module class``, ``fused output``,
            ``local shapes``).
        reason: what decided it, naming the op or module.
    """

    module: str
    kind: str
    reason: str


# Where TPLegality keeps its answers in ModelProfile.findings.
FINDINGS = "tp_legality"


def _regions_key(regions: dict[str, dict[str, str]]) -> frozenset:
    return frozenset((region, frozenset(children.items())) for region, children in regions.items())


def illegal_json(found: dict[str, IllegalSplit]) -> dict[str, list[str]]:
    """Module -> [kind, reason]: how a kept answer (ModelProfile.findings) holds illegal splits."""
    return {module: [item.kind, item.reason] for module, item in found.items()}


def illegal_of(kept: dict[str, list[str]]) -> dict[str, IllegalSplit]:
    """The illegal splits `illegal_json` wrote."""
    return {module: IllegalSplit(module, kind, reason) for module, (kind, reason) in kept.items()}


class _InputsCaptured(Exception):
    """Stops the forward `TPLegality._layer_inputs` runs once the layer's arguments are kept."""


@dataclass
class TPLegality:
    """Illegal splits per layer, found once per (layer, tp) and kept (see the module docstring)."""

    profile: "ModelProfile"
    _build: Any = None
    _built: bool = False
    _static: dict[tuple[str, int], dict[str, IllegalSplit]] = field(default_factory=dict)
    _probed: dict[tuple[str, int, frozenset], dict[str, IllegalSplit]] = field(default_factory=dict)
    _inputs: dict[str, tuple[tuple, dict] | None] = field(default_factory=dict)
    _dtensor: dict[tuple[str, int, frozenset], set[str]] = field(default_factory=dict)
    _fused: dict[tuple[str, int], dict[str, list[int]]] = field(default_factory=dict)
    _kv_groups: dict[int, KVGroups | None] = field(default_factory=dict)
    _attributes: dict[tuple[str, int, frozenset], dict[str, dict[str, int]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Answers found by an earlier plan of the same model and code (kept with its profile, or
        # found earlier in this process): no rebuild of the model to ask them again.
        kept = self.profile.findings.setdefault(FINDINGS, {"static": [], "probed": []})
        for answer in kept["static"]:
            self._static[(answer["layer"], answer["tp"])] = illegal_of(answer["illegal"])
            self._fused[(answer["layer"], answer["tp"])] = {m: list(parts) for m, parts in answer["fused"].items()}
        for answer in kept["probed"]:
            key = (answer["layer"], answer["tp"], _regions_key(answer["regions"]))
            self._probed[key] = illegal_of(answer["illegal"])
            self._dtensor[key] = set(answer["dtensor"])
            self._attributes[key] = {region: dict(found) for region, found in answer["attributes"].items()}

    def static(self, layer: str, tp: int) -> dict[str, IllegalSplit]:
        """Module -> why it cannot be split, by the class and graph rules (independent of styles)."""
        if tp <= 1:
            return {}
        if (layer, tp) not in self._static:
            found: dict[str, IllegalSplit] = {}
            ops = [op for op in self.profile.ops if op.layer == layer and op.phase == "forward"]
            split_modules = _split_candidates(self.profile, ops)
            # (An output the model's code modifies in place is no reason to keep a module whole:
            # code generation copies it, autopar.codegen.in_place.)
            fused = self._fused.setdefault((layer, tp), {})
            for item in [*self._class_rule(split_modules),
                         *self._fused_parts(layer, tp, _fused_rule(ops, split_modules), fused),
                         *_joined_rule(ops, split_modules),
                         *_too_small_rule(self.profile, split_modules, tp)]:
                found.setdefault(item.module, item)
            self._static[(layer, tp)] = found
            if self.build_failed():
                return found
            self.profile.findings[FINDINGS]["static"].append(
                {"layer": layer, "tp": tp, "illegal": illegal_json(found), "fused": dict(fused)})
        return self._static[(layer, tp)]

    def fused_parts(self, layer: str, tp: int) -> dict[str, list[int]]:
        """Fused projections of ``layer`` that split as their parts at ``tp``: FQN -> the parts'
        global sizes (autopar.solver.tp_fused)."""
        self.static(layer, tp)
        return dict(self._fused.get((layer, tp), {}))

    def _fused_parts(self, layer: str, tp: int, cut: list[IllegalSplit],
                     fused: dict[str, list[int]]) -> list[IllegalSplit]:
        """Of the projections the graph rule found cut, those whose cuts are parts each rank can
        hold a share of go to ``fused``; the others stay refused (returned)."""
        build = self._model() if cut else None
        if build is None:
            return cut
        from autopar.model_file import call_model
        from autopar.solver.tp_fused import recorded_parts
        from autopar.solver.tp_probe import run_fake

        named = dict(build.model.named_modules())
        inputs = self._layer_inputs(layer, named, call_model) if layer in named else None
        refused = []
        for item in cut:
            module = named.get(item.module)
            parts = None if module is None else recorded_parts(module, functools.partial(
                run_fake, build, named[layer] if inputs else build.model, inputs or ((build.batch,), {}),
                call_model if not inputs else None))
            if parts is not None and all(part % tp == 0 for part in parts):
                fused[item.module] = parts
            else:
                refused.append(item)
        return refused

    def probe(self, layer: str, tp: int, styles: dict[str, str]) -> dict[str, IllegalSplit]:
        """Regions of ``styles`` whose code fails on one rank's share: region's linears -> why."""
        regions = self._regions(styles)
        key = (layer, tp, _regions_key(regions))
        if key not in self._probed:
            self._dtensor[key] = set()
            self._attributes[key] = {}
            self._probed[key] = self._probe_regions(layer, regions, tp, self._dtensor[key], self._attributes[key])
            if self.build_failed():
                return self._probed[key]
            self.profile.findings[FINDINGS]["probed"].append(
                {"layer": layer, "tp": tp, "regions": regions, "illegal": illegal_json(self._probed[key]),
                 "dtensor": sorted(self._dtensor[key]), "attributes": self._attributes[key]})
        return self._probed[key]

    def region_attributes(self, layer: str, tp: int, styles: dict[str, str]) -> dict[str, dict[str, int]]:
        """Regions of ``styles`` (probed) that run their key/value groups with an attribute set:
        region -> attribute -> value (see the module docstring)."""
        self.probe(layer, tp, styles)
        key = (layer, tp, _regions_key(self._regions(styles)))
        return {region: dict(found) for region, found in self._attributes[key].items()}

    def dtensor_regions(self, layer: str, tp: int, styles: dict[str, str]) -> set[str]:
        """Regions of ``styles`` (probed) that run only with DTensor activations."""
        self.probe(layer, tp, styles)
        return set(self._dtensor[(layer, tp, _regions_key(self._regions(styles)))])

    def _layer_inputs(self, layer: str, named: dict[str, nn.Module], call_model: Any) -> tuple[tuple, dict] | None:
        """The arguments the model's forward passes ``layer`` (one fake forward, kept), so a probe
        runs that layer alone."""
        if layer not in self._inputs:
            import torch

            captured: list[tuple[tuple, dict]] = []

            def keep(module: nn.Module, args: tuple, kwargs: dict) -> None:
                if not captured:
                    captured.append((args, dict(kwargs)))
                raise _InputsCaptured  # the rest of the forward is not needed (a whole forward of a
                # 145.6B GPT on fake tensors took 0.3 s)

            handle = named[layer].register_forward_pre_hook(keep, with_kwargs=True)
            try:
                with self._build.active(), torch.no_grad():
                    call_model(self._build.model, self._build.batch)
            except _InputsCaptured:
                pass
            except Exception:  # noqa: BLE001 - without captured inputs the whole model is probed
                captured.clear()
            finally:
                handle.remove()
            self._inputs[layer] = captured[0] if captured else None
        return self._inputs[layer]

    # -- rules needing the model -----------------------------------------------------------------

    def build_failed(self) -> bool:
        """Whether the model's rebuild failed, so that its rules were skipped: answers kept for no
        later plan (autopar.profile_cache), which may rebuild it."""
        return self._built and self._build is None

    def _model(self) -> Any:
        if not self._built:
            self._built = True
            path = Path(self.profile.model_path)
            if path.is_file():
                from autopar.model_file import build_fake, build_real, load_model_file

                try:
                    kwargs = dict(self.profile.model_kwargs)
                    if self.profile.real_values:
                        self._build = build_real(load_model_file(path), kwargs, 1, None, self.profile.real_values)
                    else:
                        self._build = build_fake(load_model_file(path), kwargs, 1,
                                                 data_dependent=self.profile.data_dependent)
                except Exception:  # noqa: BLE001 - the profile was traced; a rebuild failing only skips the rules
                    self._build = None
        return self._build

    def _class_rule(self, split_modules: set[str]) -> list[IllegalSplit]:
        build = self._model()
        if build is None:
            return []
        from torch import nn

        from autopar.trace.linear_like import affine_layout

        named = dict(build.model.named_modules())
        found = []
        for module in sorted(split_modules):
            instance = named.get(module)
            if instance is None or (isinstance(instance, nn.Embedding)
                                    and type(instance).forward is nn.Embedding.forward):
                continue
            if affine_layout(instance) is not None:
                continue  # an affine map, whatever its class (GPT-2's Conv1D, FalconLinear): split like nn.Linear
            if isinstance(instance, nn.Embedding):
                # A style converts the module's inputs; a forward of its own (OPT's learned
                # positions compute indices from the mask) feeds the lookup something else.
                found.append(IllegalSplit(module, "module class",
                                          f"{module} is a {type(instance).__name__}, whose forward is not "
                                          "nn.Embedding's: a torch parallel style converts its inputs, not what it "
                                          "passes to the lookup"))
            else:
                found.append(IllegalSplit(module, "module class",
                                          f"{module} is a {type(instance).__name__}, whose forward is not an affine "
                                          "map of its input (x @ W.T + b or x @ W + b on its weight and bias alone, "
                                          "as probed on random values): no parallel style splits it"))
        return found

    def _regions(self, styles: dict[str, str]) -> dict[str, dict[str, str]]:
        """Paired regions (parent -> its linear children's styles) of ``styles``."""
        by_parent: dict[str, dict[str, str]] = {}
        for module, style in styles.items():
            by_parent.setdefault(module.rpartition(".")[0], {})[module] = style
        return {parent: children for parent, children in by_parent.items()
                if pairs(set(children.values()))}

    def _probe_regions(self, layer: str, regions: dict[str, dict[str, str]], tp: int,
                       dtensor: set[str], attributes: dict[str, dict[str, int]]) -> dict[str, IllegalSplit]:
        build = self._model()
        if build is None or not regions:
            return {}
        from autopar.model_file import call_model
        from autopar.solver.tp_fused import cutting_fused
        from autopar.solver.tp_global_shapes import dtensor_region_error
        from autopar.solver.tp_probe import group_count_attribute, narrowed_error, run_narrowed
        from autopar.trace.linear_like import affine_layout

        named = dict(build.model.named_modules())
        found: dict[str, IllegalSplit] = {}
        if tp not in self._kv_groups:
            self._kv_groups[tp] = kv_groups(self.profile, tp)
        groups = self._kv_groups[tp]
        if groups is not None:
            groups = groups.with_fused(self._fused.get((layer, tp), {}))
        inputs = self._layer_inputs(layer, named, call_model) if layer in named else None
        run = (named[layer] if inputs else build.model, inputs or ((build.batch,), {}),
               call_model if not inputs else None)
        unsplit_error, whole = run_narrowed(build, named, {}, tp, *run)  # the unsplit shapes, op by op
        if unsplit_error is not None:
            # The layer fails on fake tensors unsplit too (Qwen3-MoE's experts take a grouped GEMM
            # that wants bf16 there): a failure on a share would say nothing of the split, so the
            # probe finds nothing and compile's proof, which runs the plan, judges it.
            return {}
        for region, children in regions.items():
            linears = {name: style for name, style in children.items()
                       if style in ("colwise", "rowwise", "kv_group") and named.get(name) is not None
                       and affine_layout(named[name]) is not None}
            if not linears:
                continue
            rows = {name: groups.rows_per_rank(name) for name, style in linears.items()
                    if style == "kv_group" and groups is not None and name in groups.modules}
            if len(rows) < sum(style == "kv_group" for style in linears.values()):
                continue  # not a key/value projection of this degree (the ILP offers kv_group to no other)
            fused = {name: parts for name, parts in self._fused.get((layer, tp), {}).items()
                     if linears.get(name) in ("colwise", "kv_group")}
            # a fused projection with parts computed by group: its output's parts at their local sizes
            shares = {name: groups.local_parts(name) for name in fused if name in rows} if groups is not None else {}
            narrowed = functools.partial(narrowed_error, build, named, linears, tp, run, rows, whole,
                                         self.profile.tokens_per_sample, fused, shares)
            error = narrowed()
            if error is not None and rows and groups is not None:
                adjusted = group_count_attribute(named[region], groups, tp, narrowed)
                if adjusted is not None:
                    attributes[region] = adjusted
                    continue
            if error is not None:
                # Key/value heads by group run on local tensors only (tp_kv_groups says why)
                with cutting_fused(named, fused, shares):
                    failed = "key/value projections computed by group keep local tensors" if rows else \
                        dtensor_region_error(build, named, region, linears, tp, *run)
                if failed is None:
                    dtensor.add(region)
                    continue
                error = f"{error}; with DTensor activations: {failed}"
                for name in linears:
                    found[name] = IllegalSplit(
                        name, "local shapes",
                        f"{region} fails on one rank's share of its columns ({error}): its code reshapes by a "
                        "count the split does not divide, e.g. a hard-coded number of heads")
        return found


def _split_candidates(profile: "ModelProfile", ops: list["OpProfile"]) -> set[str]:
    """Modules with a forward GEMM or embedding lookup reading a parameter or something computed
    from parameters alone (what the ILP may split: `cost_models.weights.parameter_derived`)."""
    derived = parameter_derived(profile)
    return {op.module for op in ops if op.module is not None
            and (op.op_class == "gemm" or "embedding" in op.target and "backward" not in op.target)
            and op.name not in derived and any(name in derived for name in op.inputs)}


def _split_dim_readers(ops: list["OpProfile"], split_modules: set[str]
                       ) -> Iterator[tuple[str, "OpProfile", int, int, list[int]]]:
    """(projection's module, an op reading its output, which input of that op it is, the dim a column
    split shards in what the op reads, that input's shape), following the output through
    reshapes and shape-keeping elementwise ops of any module (its own bias add or cast, the
    block's activation: DBRX clamps its fused qkv before cutting it); a transpose or any other op
    ends the walk (past it the dims are heads or head features, which a split by heads keeps
    whole)."""
    consumers: dict[str, list["OpProfile"]] = {}
    for op in ops:
        for source in dict.fromkeys(op.inputs):
            consumers.setdefault(source, []).append(op)
    for op in ops:
        module = op.module
        if module is None or module not in split_modules or op.op_class != "gemm" or not op.output_shapes:
            continue
        frontier = [(op, len(op.output_shapes[0]) - 1)]
        seen: set[tuple[str, int]] = set()  # an output reached again by another path (a residual add)
        while frontier:
            current, dim = frontier.pop()
            if (current.name, dim) in seen:
                continue
            seen.add((current.name, dim))
            for user in consumers.get(current.name, []):
                position = user.inputs.index(current.name)
                if position >= len(user.input_shapes):
                    continue
                shape = user.input_shapes[position]
                yield module, user, position, dim, shape
                if position != 0:
                    continue
                if user.target.startswith(_RESHAPING) and user.output_shapes:
                    mapped = _reshaped_dim(shape, user.output_shapes[0], dim)
                    if mapped is not None:
                        frontier.append((user, mapped))
                elif not user.target.startswith(_CUTTING) and user.op_class in ("view", "elementwise") \
                        and user.output_shapes and user.output_shapes[0] == shape:
                    frontier.append((user, dim))


def _fused_rule(ops: list["OpProfile"], split_modules: set[str]) -> list[IllegalSplit]:
    """Projections whose output is cut along the dim a column split shards (`_split_dim_readers`)."""
    found: dict[str, IllegalSplit] = {}
    for module, user, position, dim, shape in _split_dim_readers(ops, split_modules):
        if module in found or position != 0 or not user.target.startswith(_CUTTING):
            continue
        if any(_cuts_dim(shape, out, dim) for out in user.output_shapes if out):
            found[module] = IllegalSplit(module, "fused output",
                                         f"{module}'s output is cut along its split dimension by "
                                         f"{user.target} in {user.module or user.layer}: a fused projection")
    return list(found.values())


def _joined_rule(ops: list["OpProfile"], split_modules: set[str]) -> list[IllegalSplit]:
    """Projections whose output is concatenated along the dim a column split shards: on each
    rank the concatenation joins the rank's shares of the parts, which a row-parallel projection
    after it reads as the share of the whole (rank 0 would multiply the second part's first
    features by the rows of the first part's last ones), and no shape says so."""
    found: dict[str, IllegalSplit] = {}
    for module, user, _, dim, shape in _split_dim_readers(ops, split_modules):
        joined = user.output_shapes[0] if user.target.startswith(_JOINING) and user.output_shapes else None
        if module not in found and joined and len(joined) == len(shape) and joined[dim] != shape[dim]:
            found[module] = IllegalSplit(module, "joined output",
                                         f"{module}'s output is concatenated along its split dimension by "
                                         f"{user.target} in {user.module or user.layer}")
    return list(found.values())


def _cuts_dim(shape: list[int], out: list[int], dim: int) -> bool:
    """Whether an op cutting ``shape`` into ``out`` cuts dim ``dim``: it shrinks it, or drops a dim
    that could be it. An op dropping one dim that can only be another (BLOOM's per-head
    interleaved ``qkv.view(b, s, heads, 3, d)[..., 0, :]`` selects along the 3) leaves it whole."""
    if len(out) == len(shape):
        return out[dim] != shape[dim]
    if len(out) != len(shape) - 1:
        return True
    dropped = [index for index in range(len(shape)) if shape[:index] + shape[index + 1:] == out]
    return not dropped or dim in dropped


def _reshaped_dim(before: list[int], after: list[int], dim: int) -> int | None:
    """Where dim ``dim`` of ``before`` lands in ``after`` (the outer dim when it is split into
    several), or None when it is merged with an outer dim and no longer leads."""
    outer = 1
    for size in before[:dim]:
        outer *= size
    running = 1
    for index, size in enumerate(after):
        if running == outer and size != 1:
            return index if before[dim] % size == 0 or size % before[dim] == 0 else None
        running *= size
        if running > outer:
            return None
    return None


def _too_small_rule(profile: "ModelProfile", split_modules: set[str], tp: int) -> list[IllegalSplit]:
    """Modules with a weight dim smaller than tp (Qwen2-MoE's shared-expert gate, one output
    feature): some rank would hold none of it, and AdamW's foreach step cannot keep such a
    DTensor's placement. Replicated, they cost nothing (the space's degree gate skips them too:
    autopar.solver.space.ModelShape)."""
    found = []
    for module in sorted(split_modules):
        shape = profile.param_shapes.get(f"{module}.weight", [])
        small = [dim for dim in shape if dim < tp]
        if small:
            found.append(IllegalSplit(module, "too small", f"{module}'s weight {list(shape)} has a dim of {small[0]}, "
                                                         f"fewer than tp={tp} ranks to split it over"))
    return found
