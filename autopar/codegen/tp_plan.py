"""The plan's per-module tensor-parallel choices -> torch parallel styles, as source code.

The operator-wise solver names one style per parameterised module (colwise, rowwise,
vocab_parallel, hidden_parallel, replicate). How activations are laid out between modules
follows from those choices and the model's structure:

- A *paired region* is a module whose linear children are all split, some column-wise and some
  row-wise (attention: q/k/v then out; MLP: up/gate then down). Inside it the activation stays
  sharded: columns produce shards, rows consume them and all-reduce (Megatron's pairing).
- A column-parallel linear outside a paired region gathers its output (``output_layouts=
  Replicate()``), and a row-parallel one slices its replicated input, so any mixture of styles
  still computes the unsharded model's function.
- With sequence parallelism the residual stream between layers is sharded along the sequence
  (dim 1): norms run on their shard (``SequenceParallel``), a region gathers the sequence on
  entry and reduce-scatters on exit, the first block slices its input, and the head gathers.
- A paired region whose code views by global sizes (``plan.tp_dtensor_regions``) keeps its
  activations as DTensors instead: global shapes, local shards (autopar.solver.tp_global_shapes);
  the region itself is wrapped in ``GlobalShapes``, around any input style it has.
- A paired region drawing random numbers on the rank's shards (``plan.tp_random_regions``: dropout
  on its heads) runs with its generators seeded per rank (``RankRandomNumbers``).
- A fused projection whose output the region's code cuts into parts (``plan.tp_fused``: one
  linear for q, k and v) is split as its parts (``FusedColwise``, its region under ``CutsFused``):
  each rank holds its share of every part.
- A norm over each attention head's features (``head_norm``: Qwen3's ``q_norm``) runs on the
  rank's heads (``HeadNorm``: its weight a replicated DTensor whose partial gradient is summed
  over the group; autopar.solver.tp_head_norms).
- A key/value projection of grouped-query attention with fewer heads than ranks (``kv_group``)
  computes its group's head inside its paired region (``KVGroupColwise``: the weight held split
  by rows, gathered each forward: autopar.solver.tp_kv_groups); it never runs outside one.
- Parameters tied across modules (a GPT head and its token embedding) must be sharded alike:
  the embedding takes the layout the head's style gives the shared weight.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from autopar.codegen.errors import CodegenError
from autopar.codegen.model_facts import ModelFacts
from autopar.plans import Plan
from cost_models.tp_layout import SPLIT_STYLES, SPRole, after_blocks, paired_regions as _paired_regions, sp_role

# Placement of a module's weight under each style (for matching tied parameters).
_WEIGHT_PLACEMENT = {("linear", "colwise"): "Shard(0)", ("linear", "rowwise"): "Shard(1)",
                     ("embedding", "vocab_parallel"): "Shard(0)", ("embedding", "hidden_parallel"): "Shard(1)"}
_STYLE_FOR_PLACEMENT = {("linear", "Shard(0)"): "colwise", ("linear", "Shard(1)"): "rowwise",
                        ("embedding", "Shard(0)"): "vocab_parallel", ("embedding", "Shard(1)"): "hidden_parallel"}


@dataclass(frozen=True)
class StyleSpec:
    """One parallel style as source: ``ColwiseParallel(output_layouts=Replicate())``.

    Attributes:
        style: torch class name.
        arguments: keyword -> source of its value, in order.
        why: a short comment for the generated line.
    """

    style: str
    arguments: tuple[tuple[str, str], ...] = ()
    why: str = ""

    def source(self) -> str:
        return f"{self.style}({', '.join(f'{k}={v}' for k, v in self.arguments)})"


@dataclass
class TPPlan:
    """Module FQN -> style, plus notes on adjustments made to the plan's choices."""

    styles: dict[str, StyleSpec] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    loss_parallel: bool = False
    fused_parameters: dict[str, tuple[int, list[int]]] = field(default_factory=dict)  # FQN -> (row dim, parts)


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def _module_of(parameter: str) -> str:
    return parameter.rpartition(".")[0]


def harmonise_tied(styles: dict[str, str], facts: ModelFacts, notes: list[str]) -> dict[str, str]:
    """Give modules sharing a tied weight styles that shard the weight the same way.

    The linear member (the head) decides: its style follows from the loss and logits, while
    the embedding can read either layout of the table."""
    styles = dict(styles)
    for group in facts.tied_parameters:
        modules = [_module_of(p) for p in group]
        kinds = {m: facts.kind(m) for m in modules}
        placements = {m: _WEIGHT_PLACEMENT.get((kinds[m], styles.get(m, "replicate")), "Replicate()") for m in modules}
        if len(set(placements.values())) <= 1:
            continue
        leader = next((m for m in modules if kinds[m] == "linear"), modules[0])
        for module in modules:
            if module == leader:
                continue
            wanted = _STYLE_FOR_PLACEMENT.get((kinds[module], placements[leader]), "replicate")
            notes.append(f"{module}: {styles.get(module, 'replicate')} -> {wanted} (its weight is tied to "
                         f"{leader}, which is {styles.get(leader, 'replicate')})")
            styles[module] = wanted
    return styles


def paired_regions(styles: dict[str, str], facts: ModelFacts) -> set[str]:
    """Modules whose linear children are all split, with both column- and row-wise among them
    (the rule the pricer applies too: cost_models.tp_layout)."""
    return _paired_regions(styles, facts.children, facts.kind)


def _input_layout_args(facts: ModelFacts, module: str, layout: str, desired: str) -> tuple[tuple[str, str], ...]:
    """PrepareModuleInput arguments for the module's first input, positional or by keyword.

    Further positional arguments (an attention mask) are left as they are (None layouts):
    torch wants one layout per positional input."""
    keyword = facts.modules[module].first_input if module in facts.modules else None
    if keyword is None:
        rest = ", None" * (facts.modules[module].positional_inputs - 1 if module in facts.modules else 0)
        return (("input_layouts", f"({layout}{rest},)"), ("desired_input_layouts", f"({desired}{rest},)"))
    return (("input_kwarg_layouts", f'{{"{keyword}": {layout}}}'),
            ("desired_input_kwarg_layouts", f'{{"{keyword}": {desired}}}'))


def build_tp_plan(plan: Plan, facts: ModelFacts) -> TPPlan:
    """The torch TP plan realising ``plan.tp_styles`` (see the module docstring)."""
    result = TPPlan()
    if plan.tp <= 1:
        return result
    styles = {m: s for m, s in plan.tp_styles.items() if m in facts.modules}
    missing = sorted(set(plan.tp_styles) - set(styles))
    if missing:
        raise CodegenError(f"the plan shards {missing[0]}, which the model does not have.",
                           "re-plan for this model file (the plan was made for another model).")
    styles = harmonise_tied(styles, facts, result.notes)
    regions = paired_regions(styles, facts)
    dtensor_regions = set(plan.tp_dtensor_regions) & regions
    sp = plan.sequence_parallel
    blocks = [block for container in plan.block_containers for block in facts.children.get(container, [])]
    block_set = set(blocks)
    after_last_block = after_blocks(list(plan.layer_names), plan.block_containers)
    head = _head(styles, facts, after_last_block)
    result.loss_parallel = plan.loss_parallel and head is not None and styles.get(head) == "colwise"
    if plan.loss_parallel and not result.loss_parallel:
        result.notes.append("loss parallel dropped: the LM head is not column-parallel")

    out: dict[str, StyleSpec] = {}
    for module, style in styles.items():
        kind = facts.kind(module)
        parent = _parent(module)
        in_region = parent in regions
        if kind == "embedding":
            if style == "vocab_parallel":
                out[module] = StyleSpec("RowwiseParallel",
                                        (("input_layouts", "Replicate()"), ("output_layouts", "Replicate()")),
                                        "vocabulary-parallel embedding: each rank holds a slice of the rows")
            elif style == "hidden_parallel":
                out[module] = StyleSpec("ColwiseParallel",
                                        (("input_layouts", "Replicate()"), ("output_layouts", "Replicate()")),
                                        "embedding split along the hidden dim")
            continue
        if style == "kv_group":
            out[module] = _kv_group_style(module, in_region, parent in dtensor_regions, plan.tp_kv_heads,
                                          plan.tp_fused.get(module), plan.tp_grouped_parts.get(module),
                                          facts.modules[module].transposed)
            continue
        if style == "head_norm":
            out[module] = StyleSpec("HeadNorm", (), "a norm over each head's features, on this rank's heads; its "
                                    "weight's gradient summed over the group")
            continue
        if style not in SPLIT_STYLES:
            continue
        if kind != "linear":
            raise CodegenError(f"the plan splits {module} ({facts.modules[module].class_name}) {style}, but only "
                               "nn.Linear and nn.Embedding modules can be split.",
                               f"pin {module} to replicate, or plan with plan.tp=1.")
        stream_input = sp and (module == head or module in after_last_block)
        if module == head and style == "colwise":
            arguments = [("input_layouts", "Shard(1)" if sp else "Replicate()")]
            if result.loss_parallel:
                arguments += [("output_layouts", "Shard(-1)"), ("use_local_output", "False")]
                why = "LM head: logits stay vocabulary-sharded into the loss (loss parallel)"
            else:
                arguments += [("output_layouts", "Replicate()")]
                why = "LM head: logits gathered for the loss"
            out[module] = StyleSpec("ColwiseParallel", tuple(arguments), why)
        elif style == "colwise" and in_region:
            out[module] = StyleSpec("ColwiseParallel", (), "output stays sharded for the row-parallel partner")
        elif style == "colwise":
            out[module] = StyleSpec("ColwiseParallel",
                                    (("input_layouts", "Shard(1)" if stream_input else "Replicate()"),
                                     ("output_layouts", "Replicate()")),
                                    "no row-parallel partner: output gathered")
        elif in_region and sp and _parent(parent) in block_set:
            out[module] = StyleSpec("RowwiseParallel", (("output_layouts", "Shard(1)"),),
                                    "reduce-scatter onto sequence shards")
        elif in_region:
            # Without SP; or under SP a pair nested in a block child that sequence parallelism
            # gathers whole (Qwen2-MoE's shared expert inside its MoE layer), which hands the
            # whole sequence on: a reduce-scatter here would give it a slice.
            out[module] = StyleSpec("RowwiseParallel", (), "all-reduce the partial sums")
        else:
            out[module] = StyleSpec("RowwiseParallel",
                                    (("input_layouts", "Shard(1)" if stream_input else "Replicate()"),),
                                    "no column-parallel partner: input sliced locally")
    if not sp:
        # A block whose own linears pair (Whisper's fc1 and fc2 sit in the layer beside its norms)
        # keeps a plain input: a DTensor would reach the norms' plain weights. Its column-parallel
        # linears each reduce their own input gradient, as the pricer counts (its regions are a
        # block's children: autopar.solver.tp_split.ILPSplitter._split_regions).
        entered = {r for r in (regions - block_set) & set(facts.modules)
                   if _only_linears_hold_weights(r, facts, styles)}
        for region in sorted(entered):
            # Its input as a replicated DTensor: the column-parallel matmuls reading it (q, k and
            # v) sum their input gradients as DTensors and all-reduce once, as priced (one
            # all-reduce per shared input), not once per matmul.
            out[region] = StyleSpec("PrepareModuleInput",
                                    _input_layout_args(facts, region, "Replicate()", "Replicate()")
                                    + (("use_local_output", "False"),), "one all-reduce of the input's gradient")
    if sp:
        out.update(_sequence_parallel_styles(plan, facts, styles, regions, blocks, block_set, after_last_block, head))
    _keep_dtensors(out, dtensor_regions)
    _set_region_attributes(out, {r: a for r, a in plan.tp_region_attributes.items() if r in regions})
    _seed_per_rank(out, set(plan.tp_random_regions) & regions)
    out = with_transposed_styles(out, facts)
    result.fused_parameters = _split_fused(out, {m: p for m, p in plan.tp_fused.items() if _parent(m) in regions})
    result.styles = {name: out[name] for name in facts.modules if name in out}
    return result


# Styles that shard a module's weight (the header counts them), and the transposed-weight
# variant of torch's two linear styles (sections/linear_like.py).
SPLITTING_STYLES = frozenset({"ColwiseParallel", "RowwiseParallel", "TransposedColwiseParallel",
                              "TransposedRowwiseParallel", "OwnedOutput", "FusedColwise",
                              "KVGroupColwise", "FusedKVGroupColwise"})
_TRANSPOSED = {"ColwiseParallel": "TransposedColwiseParallel", "RowwiseParallel": "TransposedRowwiseParallel"}


def with_transposed_styles(styles: dict[str, StyleSpec], facts: ModelFacts) -> dict[str, StyleSpec]:
    """``styles`` with each linear layer that stores its weight ``(in, out)`` (GPT-2's Conv1D,
    `ModuleFacts.transposed`) given the transposed variant of its style, same arguments."""
    styles = {name: StyleSpec(_TRANSPOSED[spec.style], spec.arguments, spec.why)
              if spec.style in _TRANSPOSED and name in facts.modules and facts.modules[name].transposed else spec
              for name, spec in styles.items()}
    # A split module's output is a view autograd forbids modifying in place: where the model's
    # code does (Falcon's mlp_output += ...), the output is copied once (OwnedOutput).
    return {name: StyleSpec("OwnedOutput", (("style", spec.source()),), spec.why + "; its output is copied, "
                            "which the model's code modifies in place")
            if spec.style in SPLITTING_STYLES and name in facts.modules and facts.modules[name].output_modified_in_place
            and ("use_local_output", "False") not in spec.arguments else spec
            for name, spec in styles.items()}


def _split_fused(out: dict[str, StyleSpec], fused: dict[str, list[int]]) -> dict[str, tuple[int, list[int]]]:
    """Fused projections of paired regions (``plan.tp_fused``) split as their parts: each one's
    column style wrapped in ``FusedColwise`` (``FusedKVGroupColwise`` holds its parts itself), its
    region's in ``CutsFused``; returns the
    parameters whose rows that permutes (FQN -> (row dim, parts)), which leave the run in the
    model's own order (checkpointing.RowOrders)."""
    permuted: dict[str, tuple[int, list[int]]] = {}
    for module, parts in fused.items():
        spec = out.get(module)
        if spec is None or spec.style not in ("ColwiseParallel", "TransposedColwiseParallel", "FusedKVGroupColwise"):
            continue
        transposed = spec.style == "TransposedColwiseParallel"
        if spec.style != "FusedKVGroupColwise":  # which permutes its own rows
            arguments = (("parts", repr(list(parts))), ("style", spec.source())) + ((("weight_dim", "1"),) if transposed
                                                                                   else ())
            out[module] = StyleSpec("FusedColwise", arguments, spec.why + "; a fused projection: each rank holds its "
                                    "share of every part")
        permuted[f"{module}.weight"] = (1 if transposed else 0, list(parts))
        permuted[f"{module}.bias"] = (0, list(parts))  # (a module without one never asks)
    for region in sorted({_parent(_module_of(name)) for name in permuted}):
        inner = out.get(region)
        out[region] = StyleSpec("CutsFused", (("inner", inner.source()),) if inner else (),
                                "cuts its fused projections' outputs by global sizes: each rank takes its share"
                                + (f"; {inner.why}" if inner and inner.why else ""))
    return permuted


def _kv_group_style(module: str, in_region: bool, dtensor_region: bool, kv_heads: int,
                    parts: list[int] | None = None, grouped: list[int] | None = None,
                    transposed: bool = False) -> StyleSpec:
    """``KVGroupColwise`` for a key/value projection the plan computes by group, where the
    planner offers it: inside a paired region running on local tensors; ``FusedKVGroupColwise``
    for a fused projection of ``parts`` whose ``grouped`` parts are key/value heads."""
    if not in_region or dtensor_region or kv_heads < 1:
        where = ("outside a paired region" if not in_region else "in a region keeping DTensor activations"
                 if dtensor_region else "without plan.tp_kv_heads")
        raise CodegenError(f"the plan computes {module} by key/value group {where}, which the generated code cannot "
                           "run.", "re-plan with this version of autopar (its planner offers kv_group only inside "
                           "a paired region on local tensors), or pin plan.tp to a divisor of the key/value heads.")
    if parts is None:
        return StyleSpec("KVGroupColwise", (("groups", str(kv_heads)),),
                         "fewer key/value heads than ranks: this rank computes its group's head")
    if not grouped or transposed:
        raise CodegenError(f"the plan computes the fused projection {module} by key/value group "
                           + ("with its weight stored (in, out), which the generated code does not split so."
                              if transposed else "without naming its key/value parts (plan.tp_grouped_parts)."),
                           "re-plan with this version of autopar, or pin plan.tp to a divisor of the key/value heads.")
    flags = [index in grouped for index in range(len(parts))]
    return StyleSpec("FusedKVGroupColwise", (("parts", repr(list(parts))), ("groups", str(kv_heads)),
                                             ("grouped", repr(flags))),
                     "a fused projection with fewer key/value heads than ranks: this rank computes its share of "
                     "the query part and its group's key/value heads")


def _set_region_attributes(out: dict[str, StyleSpec], attributes: dict[str, dict[str, int]]) -> None:
    """Regions whose attention repeats key/value heads by a count it holds: that count set to the
    query heads per rank (``WithAttributes``), around any style the region has."""
    for region, values in sorted(attributes.items()):
        inner = out.get(region)
        arguments = ((("attributes", repr(dict(sorted(values.items())))),)
                     + ((("inner", inner.source()),) if inner else ()))
        out[region] = StyleSpec("WithAttributes", arguments,
                                "its attention repeats this rank's key/value head to its query heads"
                                + (f"; {inner.why}" if inner and inner.why else ""))


def _seed_per_rank(out: dict[str, StyleSpec], random_regions: set[str]) -> None:
    """Regions drawing random numbers on the rank's shards run with their generators seeded per
    rank (``RankRandomNumbers``), around any style the region has."""
    for region in sorted(random_regions):
        inner = out.get(region)
        out[region] = StyleSpec("RankRandomNumbers", (("inner", inner.source()),) if inner else (),
                                "dropout on this rank's shards: this rank draws its own numbers"
                                + (f"; {inner.why}" if inner and inner.why else ""))


def _keep_dtensors(out: dict[str, StyleSpec], dtensor_regions: set[str]) -> None:
    """Regions whose code views by global sizes: column outputs stay DTensors, the row-parallel
    partner reads them as ``Shard(-1)``, and the region runs in ``GlobalShapes``."""
    for module, spec in list(out.items()):
        if _parent(module) not in dtensor_regions:
            continue
        if spec.style == "ColwiseParallel":
            out[module] = StyleSpec("ColwiseParallel", spec.arguments + (("use_local_output", "False"),),
                                    "output stays a DTensor: the region's code views it by global sizes")
        elif spec.style == "RowwiseParallel":
            out[module] = StyleSpec("RowwiseParallel", (("input_layouts", "Shard(-1)"),) + spec.arguments,
                                    spec.why + ", reading the DTensor shards")
    for region in sorted(dtensor_regions):
        inner = out.get(region)
        out[region] = StyleSpec("GlobalShapes", (("inner", inner.source()),) if inner else (),
                                "global sizes in the model's code: runs on DTensors"
                                + (f"; {inner.why}" if inner and inner.why else ""))


def _only_linears_hold_weights(region: str, facts: ModelFacts, styles: dict[str, str]) -> bool:
    """Whether a replicated DTensor can enter ``region``: every child holding parameters is a
    linear layer, or a per-head norm (``HeadNorm``: its weight a DTensor, reading a projection's
    heads). A norm inside it (a frozen GPT's ``mlp = Sequential(LayerNorm, Linear, ...)``)
    would meet the DTensor with its plain weight; such a region keeps a plain input and its
    column-parallel linears, fed by the norm, each reduce their own input gradient, as the
    pricer counts (autopar.solver.tp_split.issued_collectives: their input is made inside the
    region)."""
    return all(facts.kind(child) == "linear" or styles.get(child) == "head_norm"
               for child in facts.children.get(region, []) if facts.modules[child].has_parameters)


def _head(styles: dict[str, str], facts: ModelFacts, after_last_block: list[str]) -> str | None:
    """The LM head: the last linear layer after the last block."""
    linears = [n for n in after_last_block if facts.kind(n) == "linear"]
    return linears[-1] if linears else None


def _sequence_parallel_styles(plan: Plan, facts: ModelFacts, styles: dict[str, str], regions: set[str],
                              blocks: list[str], block_set: set[str], after_last_block: list[str],
                              head: str | None) -> dict[str, StyleSpec]:
    """Styles that keep the residual stream sharded along the sequence between layers."""
    if not blocks:
        raise CodegenError("sequence parallelism needs a block container (ModuleList of layers); the model has none.",
                           "plan with plan.sequence_parallel=false.")
    if len(plan.block_containers) > 1:
        raise CodegenError(f"sequence parallelism is written for one stack of blocks; the model has "
                           f"{len(plan.block_containers)} ({', '.join(plan.block_containers)}).",
                           "plan with plan.sequence_parallel=false.")
    out: dict[str, StyleSpec] = {}
    out[blocks[0]] = StyleSpec("PrepareModuleInput", _input_layout_args(facts, blocks[0], "Replicate()", "Shard(1)")
                               + (("use_local_output", "True"),),
                               "enter sequence parallelism: each rank keeps its slice of the sequence")
    for block in blocks:
        for child in facts.children.get(block, []):
            # One role per child, shared with the pricer (cost_models.tp_layout.sp_role), which
            # prices the work and the collectives each of these styles implies.
            role = sp_role(facts.kind(child), facts.modules[child].has_parameters, child in regions)
            if role == SPRole.LOCAL:
                continue
            if role == SPRole.SEQUENCE_SHARD:
                # A local output, like every other style here: a norm's output may be added to
                # the (local) residual stream directly (Gemma-2's post-attention norms), and
                # torch refuses an add of a Tensor and a DTensor.
                out[child] = StyleSpec("SequenceParallel", (("use_local_output", "True"),),
                                       "norm on this rank's sequence slice")
            elif role == SPRole.SPLIT_REGION:
                # The gathered input stays a DTensor: the column-parallel matmuls' input
                # gradients (Partial) add up as DTensors and leave the region in one
                # reduce-scatter, where plain tensors would all-reduce once per matmul.
                out[child] = StyleSpec("PrepareModuleInput", _input_layout_args(facts, child, "Shard(1)", "Replicate()")
                                       + (("use_local_output", "False"),),
                                       "all-gather the sequence before the split matmuls")
            elif role == SPRole.UNSUPPORTED:
                raise CodegenError(f"sequence parallelism cannot wrap {child}: a linear layer called directly on the "
                                   "residual stream.", "plan with plan.sequence_parallel=false.")
            else:
                # Only the first output is the residual-stream update (attention may also
                # return its weights); the others pass through untouched.
                extra = ", None" * ((facts.modules[child].outputs or 1) - 1)
                out[child] = StyleSpec("PrepareModuleInputOutput",
                                       _input_layout_args(facts, child, "Shard(1)", "Replicate()")
                                       + (("use_local_input", "True"), ("output_layouts", f"(Replicate(){extra},)"),
                                          ("desired_output_layouts", f"(Shard(1){extra},)"),
                                          ("use_local_output", "True")),
                                       "replicated sub-module: gather the sequence in, slice it out")
    for unit in after_last_block:
        kind = facts.kind(unit)
        if kind == "norm":
            # A DTensor output here (the head's style reads it): a local one would be a view,
            # which FSDP warns about when the final norm is wrapped on its own.
            out[unit] = StyleSpec("SequenceParallel", (), "final norm on this rank's sequence slice")
        elif unit != head and facts.modules.get(unit) and facts.modules[unit].has_parameters and unit not in styles:
            out[unit] = StyleSpec("PrepareModuleInput", _input_layout_args(facts, unit, "Shard(1)", "Replicate()")
                                  + (("use_local_output", "True"),), "leave sequence parallelism")
    if head is not None and styles.get(head, "replicate") not in SPLIT_STYLES:
        out[head] = StyleSpec("PrepareModuleInput", _input_layout_args(facts, head, "Shard(1)", "Replicate()")
                              + (("use_local_output", "True"),), "leave sequence parallelism: the head is replicated")
    return out
