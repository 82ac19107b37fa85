"""Write a GPU layout for a node of 1, 2, 4 or 8 GPUs: ``configs/<name>.pbtxt`` for every
generation model of the repository, planned for the checkpoints it will serve.

    python -m neopp.tools.gpu_layout --gpus 2 --checkpoint /models/U1-8B [--gpu-memory-gb 80]
    make serve NEOPP_CHECKPOINT=/models/U1-8B GPUS=2     # writes the layout gpus2, then serves it

The rules are stated once, in docs/deployment.md ("Writing a layout"); in short: the modes go in
pools that share their GPUs (``POOLS``), each pool takes the next GPUs and wraps to GPU 0 when the
node runs out, a pool needing more GPUs than the node has is pinned to the CPU, and then each
model in ``PRIORITY`` order keeps its GPUs only if the memory planned on each stays within the card
(``gpu_memory``), the prompt encoder first on GPU 0, where it loads by itself. A model that is not
served gets ``device: "cpu"`` and the reason in its file. Each file is a copy of the model's
``config.pbtxt`` with only its instance group and placement parameters changed, and every file
written is checked by the code a model runs at load (``neopp.serving.placement``).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError
from ..limits import Limits
from ..modes import ModeSpec, load_mode
from ..serving.model_settings import project_root
from ..serving.placement import check_layout, read_placement_fields
from .gpu_memory import GB, Need, TowerSizes, encoder_need, gb, generation_tower, language_tower, rank_need
from .layout_text import FileSpec, render

COUNTS = (1, 2, 4, 8)
# Models of one pool share their GPUs by declaration; the pools take GPUs in this order.
POOLS = (("neopp_dense", "neopp_dense_8steps"),  # the same weights; 8 steps without CFG cost ~1/12
         ("neopp_dense_fp8", "neopp_moe"),  # the FP8 tower's half bytes leave the card to the experts
         ("neopp_dense_cfg", "neopp_moe_cfg"),  # two CFG pairs of one rank shape
         ("neopp_dense_cfg_seq",))  # the fastest mode, for the largest images, alone where it can be
# The order models claim memory (after the prompt encoder): the dense checkpoint's plain mode, its
# parallel twins, its variants, then the MoE checkpoint's modes.
PRIORITY = ("neopp_dense", "neopp_dense_cfg", "neopp_dense_cfg_seq", "neopp_dense_8steps", "neopp_dense_fp8",
            "neopp_moe", "neopp_moe_cfg")
ENCODER = "neopp_prompt_encoder"
ENCODER_GPU = 0  # device auto: a KIND_CPU model's instance 0 takes the first GPU
WRITTEN_NAME = re.compile(r"gpus\d+")  # the names `make serve GPUS=N` writes (not kept in git)


@dataclass(frozen=True)
class Model:
    """One model folder of the repository, as its config.pbtxt describes it."""

    name: str
    folder: Path
    base: str
    params: dict[str, str]
    mode: ModeSpec | None  # a generation model's mode file

    @property
    def engine(self) -> str:
        """The model whose engine runs a front's requests ("" for a model with its own engine)."""
        return self.params.get("engine_model", "").strip()


@dataclass
class Placed:
    """The plan for one model: its GPUs (one per rank) or why it is not served."""

    gpus: tuple[int, ...] = ()
    reason: str = ""
    need: Need | None = None
    share_with: tuple[str, ...] = ()


@dataclass
class Plan:
    name: str
    count: int
    memory_gb: float
    models: dict[str, Placed] = field(default_factory=dict)
    load: dict[int, list[tuple[str, int]]] = field(default_factory=dict)  # GPU -> (model, bytes)

    def served(self, model: str) -> bool:
        placed = self.models.get(model)
        return placed is not None and not placed.reason


def read_models(repository: Path) -> dict[str, Model]:
    """Every model folder with a config.pbtxt; a generation model's mode file read as the model
    reads it (relative to the folder holding the repository)."""
    out = {}
    for folder in sorted(p for p in repository.iterdir() if (p / "config.pbtxt").is_file()):
        base = (folder / "config.pbtxt").read_text()
        fields = read_placement_fields(base)
        params = {k: str(v.get("string_value", "")) for k, v in fields["parameters"].items()}
        mode = load_mode(project_root(folder) / params["mode_file"]) if params.get("mode_file") else None
        out[folder.name] = Model(folder.name, folder, base, params, mode)
    return out


def pool_gpus(models: dict[str, Model], count: int) -> dict[str, tuple[int, ...] | str]:
    """Each pooled model's GPUs by the wrap rule, or why its pool cannot be placed on ``count``."""
    out: dict[str, tuple[int, ...] | str] = {}
    start = 0
    for pool in POOLS:
        present = [models[m] for m in pool if m in models and models[m].mode is not None]
        if not present:
            continue
        ranks = {m.mode.world_size for m in present if m.mode is not None}
        if len(ranks) != 1:
            raise ConfigError(f"the pool {list(pool)} mixes rank counts {sorted(ranks)}; its models cannot share GPUs")
        world = ranks.pop()
        for m in present:
            out[m.name] = (f"needs {world} GPUs; this layout has {count}" if world > count
                           else tuple((start + i) % count for i in range(world)))
        if world <= count:
            start = (start + world) % count
    return out


def plan_layout(models: dict[str, Model], count: int, memory_gb: float, tower_of: dict[str, TowerSizes | None],
                encoder: TowerSizes | None, wanted: Sequence[str], name: str = "") -> Plan:
    """Place every generation model on ``count`` GPUs of ``memory_gb`` each (see the module doc).

    ``tower_of``: the tower each mode version ("dense", "moe") loads, None where no checkpoint was
    given; ``encoder``: the prompt encoder's tower, None where prompts come from elsewhere;
    ``wanted``: the models the server will load (the others are pinned off, claiming nothing)."""
    if count not in COUNTS:
        raise ConfigError(f"{count} GPUs: a layout is written for 1, 2, 4 or 8 GPUs (the modes take 1, 2 or 4 "
                          "ranks each, and only those counts tile them)")
    if not memory_gb > 0:
        raise ConfigError(f"the memory per GPU must be a positive number of GB, got {memory_gb}")
    plan = Plan(name or f"gpus{count}", count, memory_gb, load={g: [] for g in range(count)})
    capacity = memory_gb * GB
    if ENCODER in models and ENCODER in wanted:
        if encoder is None:
            plan.models[ENCODER] = Placed(reason="no prompt checkpoint (one with tokenizer.json); prompts come "
                                                 "from LightLLM")
        else:
            plan.models[ENCODER] = _claim(plan, ENCODER, (ENCODER_GPU,), encoder_need(encoder), capacity)
    places = pool_gpus(models, count)
    for model in [models[m] for m in PRIORITY if m in models] + _unpooled(models):
        plan.models[model.name] = _place(plan, model, places.get(model.name), tower_of, wanted, capacity)
    for model in models.values():
        if model.engine and model.mode is not None:
            host = plan.models.get(model.engine)
            plan.models[model.name] = Placed(reason="" if host and not host.reason else
                                             f"its engine model {model.engine} is not served")
    for model, placed in plan.models.items():
        if placed.gpus:
            placed.share_with = tuple(m for m, other in plan.models.items()
                                      if m != model and m != ENCODER and set(other.gpus) & set(placed.gpus))
    return plan


def _unpooled(models: dict[str, Model]) -> list[Model]:
    return [m for m in models.values() if m.mode is not None and not m.engine and m.name not in PRIORITY]


def _place(plan: Plan, model: Model, gpus: tuple[int, ...] | str | None, tower_of: dict[str, TowerSizes | None],
           wanted: Sequence[str], capacity: float) -> Placed:
    assert model.mode is not None
    if model.name not in wanted:
        return Placed(reason="not among the models to serve")
    if gpus is None:
        return Placed(reason="no rule of the layout writer places it")
    if isinstance(gpus, str):
        return Placed(reason=gpus)
    tower = tower_of.get(model.mode.version)
    if tower is None:
        return Placed(reason="no MoE checkpoint given" if model.mode.version == "moe" else "no checkpoint given")
    return _claim(plan, model.name, gpus, rank_need(model.mode, tower, Limits.from_params(model.params)), capacity)


def _claim(plan: Plan, model: str, gpus: tuple[int, ...], need: Need, capacity: float) -> Placed:
    """Take ``gpus`` if each keeps within ``capacity`` with ``need`` added, else say which does not."""
    if need.total > capacity:
        return Placed(reason=f"needs {need.describe()} per GPU, over the {plan.memory_gb:g} GB card", need=need)
    for g in gpus:
        held = sum(b for _, b in plan.load[g])
        if held + need.total > capacity:
            others = ", ".join(m for m, _ in plan.load[g])
            return Placed(reason=f"GPU {g} would hold {gb(held + need.total)} of {plan.memory_gb:g} GB: {others} "
                                 f"there already, and this model needs {need.describe()}", need=need)
    for g in gpus:
        plan.load[g].append((model, need.total))
    return Placed(gpus=gpus, need=need)


def served_models(plan: Plan, models: dict[str, Model], wanted: Sequence[str]) -> list[str]:
    """The models of ``wanted`` the layout serves: those it places, fronts of a served engine, the
    prompt encoder where it fits, neopp_t2i where its encoder is served, and every other model."""
    out = []
    for name in wanted:
        model = models.get(name)
        encoder = model.params.get("encoder_model", "").strip() if model else ""
        if name in plan.models and not plan.served(name):
            continue
        if encoder and encoder in models and not plan.served(encoder):
            continue
        out.append(name)
    return out


def file_spec(plan: Plan, model: Model) -> FileSpec:
    placed = plan.models[model.name]
    header = (f"# Layout {plan.name} for {plan.count} GPU{'s' * (plan.count > 1)} of {plan.memory_gb:g} GB each "
              f"(tritonserver --model-config-name={plan.name}), written",
              "# by python -m neopp.tools.gpu_layout by the rules of docs/deployment.md: rewrite it, do not edit it.")
    return FileSpec(plan.name, header, placed.gpus, placed.reason, placed.share_with, model.engine)


def write_layout(plan: Plan, models: dict[str, Model]) -> list[Path]:
    """Write ``configs/<name>.pbtxt`` of every generation model, then load-check each one."""
    written = []
    for model in models.values():
        if model.mode is None:
            continue
        path = model.folder / "configs" / f"{plan.name}.pbtxt"
        path.parent.mkdir(exist_ok=True)
        path.write_text(render(model.base, file_spec(plan, model)))
        written.append(path)
    for path in written:
        model = models[path.parent.parent.name]
        assert model.mode is not None
        own = read_placement_fields(path.read_text())
        check_layout(own, model.folder, model.mode.world_size, plan.count if plan.served(model.name) else 0)
    return written


def gpu_memory_gb(count: int) -> float:
    """The smallest GPU's memory in GB (10^9 bytes), as nvidia-smi reports it (in MiB)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        raise ConfigError("nvidia-smi is not on this machine: give the memory per GPU in GB "
                          "(--gpu-memory-gb, make serve GPU_MEMORY_GB=...)")
    done = subprocess.run([exe, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                          capture_output=True, text=True, timeout=60)
    try:
        mib = [float(line) for line in done.stdout.split()]
    except ValueError:
        mib = []
    if done.returncode or not mib:
        raise ConfigError(f"nvidia-smi did not report the GPUs' memory ({(done.stderr or done.stdout).strip()!r}); "
                          "give it in GB (--gpu-memory-gb)")
    if len(mib) < count:
        raise ConfigError(f"nvidia-smi sees {len(mib)} GPU{'s' * (len(mib) > 1)}; "
                          f"a layout of {count} could not load here")
    return round(min(mib) * 2**20 / GB, 1)


def towers(checkpoint: Path, moe: Path | None, prompt: Path | None) -> tuple[dict[str, TowerSizes | None],
                                                                            TowerSizes | None]:
    """The towers each mode version loads, and the prompt encoder's, read from their files."""
    def read(what: str, folder: Path, reader: Callable[[Path], TowerSizes]) -> TowerSizes:
        try:
            return reader(folder)
        except (ConfigError, OSError) as exc:
            raise ConfigError(f"{what} {folder}: {exc}") from exc

    tower_of = {"dense": read("checkpoint", checkpoint, generation_tower),
                "moe": read("MoE checkpoint", moe, generation_tower) if moe else None}
    return tower_of, read("prompt checkpoint", prompt, language_tower) if prompt else None


def summary(plan: Plan, served: list[str]) -> str:
    lines = [f"layout {plan.name}: {plan.count} GPU{'s' * (plan.count > 1)} of {plan.memory_gb:g} GB each"]
    for g, held in plan.load.items():
        total = sum(b for _, b in held)
        lines.append(f"  GPU {g}: {gb(total)} of {plan.memory_gb:g} GB planned: "
                     + (", ".join(f"{m} {gb(b)}" for m, b in held) or "nothing"))
    lines.append("  served: " + " ".join(served))
    left = [(m, p.reason) for m, p in plan.models.items() if p.reason]
    if left:
        lines.append("  not served (a generation model's file pins it to the CPU):")
        lines += [f"    {m}: {reason}" for m, reason in left]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m neopp.tools.gpu_layout", description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, required=True, help="GPUs of the node: 1, 2, 4 or 8")
    parser.add_argument("--gpu-memory-gb", type=float, help="memory per GPU in GB (default: nvidia-smi's)")
    parser.add_argument("--name", help="the layout's name (default: gpus<N>)")
    parser.add_argument("--checkpoint", type=Path, required=True, help="the dense checkpoint (every dense mode)")
    parser.add_argument("--moe-checkpoint", type=Path, help="the MoE checkpoint (without it the MoE modes are off)")
    parser.add_argument("--prompt-checkpoint", type=Path, help="the prompt encoder's checkpoint (with tokenizer.json)")
    parser.add_argument("--repository", type=Path, default=Path("model_repository"))
    parser.add_argument("--models", help="the models the server loads, space-separated (default: all)")
    parser.add_argument("--served", action="store_true", help="print the models it serves of --models; write nothing")
    args = parser.parse_args(argv)
    try:
        models = read_models(args.repository)
        wanted = args.models.split() if args.models else list(models)
        memory = args.gpu_memory_gb if args.gpu_memory_gb is not None else gpu_memory_gb(args.gpus)
        tower_of, encoder = towers(args.checkpoint, args.moe_checkpoint, args.prompt_checkpoint)
        plan = plan_layout(models, args.gpus, memory, tower_of, encoder, wanted, args.name or "")
        served = served_models(plan, models, wanted)
        if args.served:
            print(" ".join(served))
            return 0
        written = write_layout(plan, models)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(summary(plan, served))
    print(f"  wrote configs/{plan.name}.pbtxt for {len(written)} models in {args.repository}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
