"""Mamba and Mamba2 mixers over a flat batch of tokens, with their state in slots.

The torch path here is the reference (opt "O0;attention=torch_native"; with the C++ kernels,
every level's, decode tokens go through kernels/ssm_decode.cpp): float32 throughout, the same math as
transformers' own implementations. Each sequence's tokens are one ``StateRun``: a prompt chunk is
convolved and scanned from its slot's state (zeros at position 0) and the new state written back,
so a prompt scanned chunk by chunk ends where one pass would. Mamba2 prompt chunks use the
chunked (SSD) form; single decode tokens of many sequences are one batched update; a run with
history slots (a step with draft tokens) goes token by token and keeps every intermediate state.
On the C++ path (``ssm_kernels``), single decode tokens go through kernels that update the
states in place in their slots.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from lmserve.layers.linear import ACT_TENSOR_DTYPES, Weight, dense_weight, make_linear
from lmserve.layers.ssm_kernels import SSMKernels
from lmserve.models.args import SSMArgs


@dataclass(frozen=True)
class StateRun:
    """One sequence's tokens in a step, as the recurrent layers see them."""

    offset: int  # the row of its first token in the step
    length: int
    slot: int  # its state: read before (unless ``fresh``), written after
    fresh: bool  # it starts at position 0: from a zero state
    history: tuple[int, ...] = ()  # slots for the states after each of its tokens but the last


@dataclass
class StateMeta:
    """The step's runs, with the single-token runs from a stored state gathered for one batched
    update (the decode steps' common case)."""

    runs: list[StateRun]
    singles: list[StateRun] = field(default_factory=list)
    others: list[StateRun] = field(default_factory=list)
    single_rows: Optional[torch.Tensor] = None
    single_slots: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        for r in self.runs:
            if r.length == 1 and not r.fresh and not r.history:
                self.singles.append(r)
            elif r.length:
                self.others.append(r)
        self.single_rows = torch.tensor([r.offset for r in self.singles], dtype=torch.long)
        self.single_slots = torch.tensor([r.slot for r in self.singles], dtype=torch.long)


class MambaMixer:
    """A Mamba (``ssm.version`` 1) or Mamba2 (2) mixer: ``w`` holds its tensors under
    transformers' names after ``prefix`` (``in_proj``, ``conv1d``, ``A_log``, ``D``, ``out_proj``;
    Mamba: ``x_proj``, ``dt_proj``; Mamba2: ``dt_bias``, ``norm``)."""

    def __init__(self, ssm: SSMArgs, w: dict[str, Weight], prefix: str, fmt: str, act: str,
                 norm_eps: float) -> None:
        def get(name: str) -> torch.Tensor:  # Mamba models come from Hugging Face files: dense
            return dense_weight(w[prefix + name])

        def bias_of(name: str) -> Optional[torch.Tensor]:
            b = w.get(prefix + name)
            return None if b is None else dense_weight(b)

        self.ssm = ssm
        self.in_proj = make_linear([get("in_proj.weight")], bias_of("in_proj.bias"), fmt, act)
        self.out_proj = make_linear([get("out_proj.weight")], bias_of("out_proj.bias"), fmt, act)
        self.conv_weight = get("conv1d.weight").float().reshape(ssm.conv_dim, ssm.conv_kernel)
        bias = bias_of("conv1d.bias")
        self.conv_bias = bias.float() if bias is not None else torch.zeros(ssm.conv_dim)
        self.A = -torch.exp(get("A_log").float())  # (I, N) Mamba; (H,) Mamba2
        self.D = get("D").float()
        if ssm.version == 1:
            # The scan reads dt, B and C from x; dt through a low-rank projection with a bias.
            self.x_proj = get("x_proj.weight").float()
            self.dt_proj = get("dt_proj.weight").float()
            self.dt_bias = get("dt_proj.bias").float()
        else:
            self.dt_bias = get("dt_bias").float()
            self.norm = get("norm.weight").float()
        self.eps = norm_eps
        self.dtype = ACT_TENSOR_DTYPES[act]  # into out_proj

    def __call__(self, h: torch.Tensor, meta: StateMeta, conv: torch.Tensor, ssm: torch.Tensor,
                 kernels: Optional[SSMKernels] = None) -> torch.Tensor:
        """The mixer's output ``(T, D)`` for the normed input ``h`` ``(T, D)``; reads and writes
        the runs' slots of this layer's ``conv`` and ``ssm`` state (single decode tokens
        through the C++ ``kernels`` where given)."""
        s = self.ssm
        proj = self.in_proj(h).float()  # (T, E)
        if s.version == 1:
            x, z = proj.split([s.inner, s.inner], -1)
        else:
            z, x, dt = proj.split([s.inner, s.conv_dim, s.num_heads], -1)
        u = torch.empty_like(x)  # the convolution's output, silu'd
        y = torch.empty(h.shape[0], s.inner)  # the scan's output (before D and the gate)
        if meta.singles:
            rows, slots = meta.single_rows, meta.single_slots
            assert rows is not None and slots is not None  # StateMeta.__post_init__ sets them
            if kernels is not None:
                u[rows] = kernels.conv_step(x[rows], conv, slots, self.conv_weight, self.conv_bias)
                y[rows] = self._kernel_scan_step(kernels, u[rows], None if s.version == 1 else dt[rows],
                                                 ssm, slots)
            else:
                u[rows] = self._conv_step(x[rows], conv, slots)
                y[rows] = self._scan_step(u[rows], None if s.version == 1 else dt[rows], ssm, slots)
        for r in meta.others:
            span = slice(r.offset, r.offset + r.length)
            u[span] = self._conv_run(x[span], conv, r)
            y[span] = self._scan_run(u[span], None if s.version == 1 else dt[span], ssm, r)
        if s.version == 1:
            y = (y + u * self.D) * F.silu(z)
        else:
            xs = u[:, : s.inner]
            y = y + (xs.view(-1, s.num_heads, s.head_dim) * self.D[:, None]).view(-1, s.inner)
            y = self._gated_norm(y, z)
        return self.out_proj(y.to(self.dtype))

    # -- the causal convolution ------------------------------------------------------------------

    def _conv_step(self, x: torch.Tensor, conv: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """One token each of ``len(slots)`` sequences: ``x`` (B, C) -> (B, C)."""
        window = torch.cat([conv[slots], x.unsqueeze(-1)], -1)  # (B, C, K)
        conv[slots] = window[:, :, 1:]
        return F.silu((window * self.conv_weight).sum(-1) + self.conv_bias)

    def _conv_run(self, x: torch.Tensor, conv: torch.Tensor, r: StateRun) -> torch.Tensor:
        """The run's tokens ``x`` (n, C) -> (n, C), after the slot's last inputs (zeros when
        fresh); leaves the last K - 1 inputs in the slot, and those after each token in the
        history slots."""
        k = self.ssm.conv_kernel
        before = torch.zeros(k - 1, x.shape[1]) if r.fresh else conv[r.slot].t()
        full = torch.cat([before, x])  # (K - 1 + n, C)
        out = F.conv1d(full.t().unsqueeze(0), self.conv_weight.unsqueeze(1), self.conv_bias,
                       groups=x.shape[1])[0].t()  # (n, C)
        for t, slot in enumerate(r.history):
            conv[slot] = full[t + 1 : t + k].t()
        conv[r.slot] = full[-(k - 1):].t()
        return F.silu(out)

    # -- the selective scan ------------------------------------------------------------------------

    def _scan_inputs(self, u: torch.Tensor, dt: Optional[torch.Tensor]):
        """Per token: x, the time step after softplus, B and C (Mamba2: per head)."""
        s = self.ssm
        if s.version == 1:
            dt_low, B, C = (u @ self.x_proj.t()).split([s.dt_rank, s.state_size, s.state_size], -1)
            return u, F.softplus(dt_low @ self.dt_proj.t() + self.dt_bias), B, C
        x, B, C = u.split([s.inner, s.n_groups * s.state_size, s.n_groups * s.state_size], -1)
        per_group = s.num_heads // s.n_groups
        B = B.view(-1, s.n_groups, s.state_size).repeat_interleave(per_group, 1)  # (n, H, N)
        C = C.view(-1, s.n_groups, s.state_size).repeat_interleave(per_group, 1)
        assert dt is not None  # Mamba2's projection gives its time steps
        dt = F.softplus(dt + self.dt_bias)  # (n, H)
        return x.view(-1, s.num_heads, s.head_dim), dt, B, C

    def _update(self, state: torch.Tensor, x, dt, B, C) -> torch.Tensor:
        """One token of each of a batch of states: updates ``state`` in place, returns y.
        Mamba: state (b, I, N), x and dt (b, I), B and C (b, N). Mamba2: state (b, H, P, N),
        x (b, H, P), dt (b, H), B and C (b, H, N)."""
        if self.ssm.version == 1:
            state.mul_(torch.exp(dt[..., None] * self.A)).add_((dt * x)[..., None] * B[:, None])
            return (state @ C[..., None])[..., 0]  # (b, I)
        decay = torch.exp(dt * self.A)[..., None, None]  # (b, H, 1, 1)
        state.mul_(decay).add_((dt[..., None] * x)[..., None] * B[:, :, None])
        return torch.einsum("bhpn,bhn->bhp", state, C).flatten(1)  # (b, I)

    def _scan_step(self, u: torch.Tensor, dt: Optional[torch.Tensor], ssm: torch.Tensor,
                   slots: torch.Tensor) -> torch.Tensor:
        state = ssm[slots]
        y = self._update(state, *self._scan_inputs(u, dt))
        ssm[slots] = state
        return y

    def _kernel_scan_step(self, kernels: SSMKernels, u: torch.Tensor, dt: Optional[torch.Tensor],
                          ssm: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        s = self.ssm
        if s.version == 2:
            assert dt is not None  # Mamba2's projection gives its time steps
            return kernels.scan_step_v2(ssm, slots, u, dt, self.dt_bias, self.A, s)
        dt_low, bc = (u @ self.x_proj.t()).split([s.dt_rank, 2 * s.state_size], -1)
        dt = F.softplus(dt_low @ self.dt_proj.t() + self.dt_bias)
        return kernels.scan_step_v1(ssm, slots, u, dt, self.A, bc)

    def _scan_run(self, u: torch.Tensor, dt: Optional[torch.Tensor], ssm: torch.Tensor,
                  r: StateRun) -> torch.Tensor:
        """The run's scan output (n, I) from its slot's state; writes the final state (and, with
        history, the one after each token)."""
        x, dt, B, C = self._scan_inputs(u, dt)
        state = torch.zeros(self.ssm.ssm_state_shape) if r.fresh else ssm[r.slot].clone()
        if self.ssm.version == 2 and not r.history:
            # Prompt chunks clamp the time step to the model's limits; token steps do not (as
            # transformers and mamba_ssm: the default limits, (0, inf), change nothing).
            y, state = self._chunk_scan(x, dt.clamp(*self.ssm.dt_limit), B, C, state)
            ssm[r.slot] = state
            return y
        state = state.unsqueeze(0)
        ys = []
        for t in range(x.shape[0]):
            ys.append(self._update(state, x[t : t + 1], dt[t : t + 1], B[t : t + 1], C[t : t + 1]))
            if t < len(r.history):
                ssm[r.history[t]] = state[0]
        ssm[r.slot] = state[0]
        return torch.cat(ys)

    def _chunk_scan(self, x, dt, B, C, state):
        """Mamba2's chunked scan of one sequence (the state-space duality form: within a chunk
        a masked, decayed attention-like product; across chunks the state carried): x (n, H, P),
        dt (n, H), B and C (n, H, N), state (H, P, N) -> y (n, I) and the final state."""
        n, length = x.shape[0], self.ssm.chunk_size
        pad = -n % length

        def chunks(t: torch.Tensor) -> torch.Tensor:  # (n, ...) -> (c, l, ...), zero padded
            return F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad)).view(-1, length, *t.shape[1:])

        xdt = chunks(x * dt[..., None])  # (c, l, H, P)
        a = chunks(dt * self.A).cumsum(1)  # (c, l, H): log decay from the chunk's start
        B, C = chunks(B), chunks(C)
        # Within a chunk: token i sees token j <= i decayed by exp(a_i - a_j).
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        decay = (a[:, :, None] - a[:, None]).masked_fill(~causal[None, :, :, None], float("-inf")).exp()
        scores = torch.einsum("cihn,cjhn->cijh", C, B) * decay  # (c, l, l, H)
        y = torch.einsum("cijh,cjhp->cihp", scores, xdt)
        # Each chunk's contribution to the state at its end, then the states carried across.
        to_end = torch.exp(a[:, -1:] - a)  # (c, l, H)
        added = torch.einsum("cjhn,cjh,cjhp->chpn", B, to_end, xdt)
        starts = []
        for c in range(added.shape[0]):
            starts.append(state)
            state = state * torch.exp(a[c, -1])[:, None, None] + added[c]
        y = y + torch.einsum("cihn,chpn->cihp", C, torch.stack(starts)) * a.exp()[..., None]
        return y.reshape(-1, self.ssm.inner)[:n], state

    def _gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Mamba2's RMSNorm of ``y * silu(z)`` within each group of channels."""
        s = self.ssm
        g = (y * F.silu(z)).view(-1, s.n_groups, s.inner // s.n_groups)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.norm * g.view(-1, s.inner)
