"""MoE test material: a small random MoE layer (`make_moe`), random fused-MoE calls (`make_moe_case`) and an
independent float64 oracle of the fused MoE (`moe_oracle`, a plain loop over tokens and slots)."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specmla.config import ModelConfig


def make_moe(kind: str, seed: int = 0):
    """A small random DeepSeek MoE layer of the V2 (`kind="v2"`) or V3 (`"v3"`) routing kind."""
    from specmla.model.deepseek import MoE  # here, so that the op-level helpers below need no model

    cfg = ModelConfig.from_dict({
        "architectures": ["DeepseekV3ForCausalLM" if kind == "v3" else "DeepseekV2ForCausalLM"],
        "vocab_size": 10, "hidden_size": 48, "intermediate_size": 64, "moe_intermediate_size": 24,
        "num_hidden_layers": 2, "num_attention_heads": 2, "n_routed_experts": 12, "n_shared_experts": 1,
        "num_experts_per_tok": 3, "n_group": 4, "topk_group": 2, "first_k_dense_replace": 0,
        "topk_method": "noaux_tc" if kind == "v3" else "group_limited_greedy",
    })
    torch.manual_seed(seed)
    moe = MoE(cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.2)
        if moe.gate.e_score_correction_bias is not None:
            moe.gate.e_score_correction_bias.normal_(0, 0.1)
    return moe


@dataclass
class MoECase:
    """The tensors of one `fused_moe` call."""

    x: torch.Tensor  # [T, H]
    w_gate_up: torch.Tensor  # [E, 2I, H]
    w_down: torch.Tensor  # [E, H, I]
    topk_weights: torch.Tensor  # fp32 [T, k]
    topk_ids: torch.Tensor  # [T, k], distinct experts per token
    shared: tuple | None  # (w_gate_up_shared [2·Is, H], w_down_shared [H, Is]) or None

    @property
    def args(self) -> tuple:
        return self.x, self.w_gate_up, self.w_down, self.topk_weights, self.topk_ids

    def tensors(self) -> list:
        return [*self.args, *(self.shared or ())]


def random_ids(T: int, E: int, k: int, g: torch.Generator, device="cpu", dtype=torch.int64) -> torch.Tensor:
    """[T, k] ids, k distinct experts of E per token, uniformly."""
    return torch.rand(T, E, generator=g, device=device).argsort(dim=1)[:, :k].to(dtype)


def make_moe_case(T: int, E: int, k: int, H: int, I: int, Is: int | None = None, dtype=torch.float32, seed: int = 0,
                  device="cpu", ids_dtype=torch.int64) -> MoECase:
    """Random experts scaled so that every projection has unit-size outputs; routing weights in [0.1, 1.1);
    shared experts of width Is when Is is given."""
    g = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape, fan_in=1):
        return (torch.randn(*shape, generator=g, device=device) / fan_in ** 0.5).to(dtype)

    shared = (rnd(2 * Is, H, fan_in=H), rnd(H, Is, fan_in=Is)) if Is else None
    return MoECase(x=rnd(T, H), w_gate_up=rnd(E, 2 * I, H, fan_in=H), w_down=rnd(E, H, I, fan_in=I),
                   topk_weights=torch.rand(T, k, generator=g, device=device) + 0.1,
                   topk_ids=random_ids(T, E, k, g, device, ids_dtype), shared=shared)


def moe_oracle(x, w_gate_up, w_down, topk_weights, topk_ids, shared=None) -> torch.Tensor:
    """float64 [T, H] on the CPU: for each token and each slot with an id in [0, E), the expert's
    w_down (silu(gate x) ⊙ up x) times the slot's weight, plus the shared experts with weight 1. Only the
    chosen experts' weights are read."""
    x = x.detach().double().cpu()
    ids = topk_ids.cpu().tolist()
    wts = topk_weights.detach().double().cpu()
    T, H = x.shape
    E, I = w_gate_up.shape[0], w_down.shape[2]
    out = torch.zeros(T, H, dtype=torch.float64)
    experts = {}
    for t in range(T):
        for j, e in enumerate(ids[t]):
            if not 0 <= e < E:
                continue
            if e not in experts:
                experts[e] = (w_gate_up[e].detach().double().cpu(), w_down[e].detach().double().cpu())
            wgu, wd = experts[e]
            gu = wgu @ x[t]
            out[t] += wts[t, j] * (wd @ (F.silu(gu[:I]) * gu[I:]))
    if shared is not None:
        sgu, sd = (w.detach().double().cpu() for w in shared)
        Is = sd.shape[1]
        gu = x @ sgu.T
        out += (F.silu(gu[:, :Is]) * gu[:, Is:]) @ sd.T
    return out


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """The worst token's error over the largest token's norm (float64): one wrong row cannot hide in an average."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    return ((got - want).norm(dim=1).max() / want.norm(dim=1).max()).item()


def fro_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative Frobenius error (float64)."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    return ((got - want).norm() / want.norm()).item()
