"""What coarser token-axis scales would cost the FP8 weight gradients in accuracy (CPU, torch's e4m3 cast).

dW = aᵀ b over one expert's rows (a: rows x P, b: rows x Q), both operands e4m3 with fp32 scales along the token
axis, against the float64 product, under five scalings (the accuracy half of a trade whose speed half is in
docs/PERFORMANCE.md, "What the weight gradients' main loop is held by: probes": with b's scales constant over a block's
K, dW13 and dW2 ran 16-17% faster at 235B, before the amax pass that per-expert or per-layer scales need):

* ``tile/tile``: both per channel and 128 rows, DeepSeek-V3's 128x1 groups (``reference.quantize_tile_cols``), what
  ``autograd.FP8_WGRAD`` computes;
* ``tile/expert``: b per channel over all the expert's rows, so that its scale leaves the GEMM's K-loop for the
  epilogue (dW13's with ``MEGAMOE_FP8_WGRAD_X_SCALES=expert``, b being x);
* ``expert/expert``: both per channel over all the rows;
* ``tile/layer``: b per channel over all the layer's rows (``--layer-rows``, the expert's among them, of the same
  distribution): the cheapest of these to compute (one pass over the tokens, not over each expert's rows), at the
  price of the layer's amax standing for the expert's (dW13's with ``MEGAMOE_FP8_WGRAD_X_SCALES=layer``);
* ``tile/block``: b per 128 rows x 128 channels (the weights' block shape), so that a 128-column half of a block
  promotes by one scale per row, a's times b's block's, as the sorted-rows kernel does (the same "A's row scales
  only" timing: the promotion's cost, not where b's scale is applied).

Data: normal; normal with 1% of the rows 100x larger (outlier tokens); Student-t with 2 degrees of freedom (heavy
tails). Relative error: the Frobenius norm of the difference over the reference's.

``python -m tools.fp8_wgrad_scales [--rows 1024] [--cols 256] [--layer-rows 16384] [--seed 0]``
"""

from __future__ import annotations

import argparse

import torch

from megamoe import reference

SCALINGS = ("tile/tile", "tile/expert", "expert/expert", "tile/layer", "tile/block")
KINDS = ("normal", "outlier rows", "student-t(2)")


def per_tile(a: torch.Tensor) -> torch.Tensor:
    """``a`` (rows, C) through the recipe's 128x1 groups and back, in float64: (C, rows)."""
    rows = a.shape[0]
    offsets = torch.tensor([0, rows])  # one expert
    q, s = reference.quantize_tile_cols(a, offsets)
    return reference.dequantize_tile_cols(q, s, offsets)[0][:, :rows]


def per_expert(a: torch.Tensor) -> torch.Tensor:
    """``a`` (rows, C) with one scale per channel over all its rows (one group of the recipe's rounding per channel,
    ``reference.quantize_groups``), e4m3 and back in float64: (C, rows)."""
    q, s = reference.quantize_groups(a.t().float())
    return q.double() * s.double()[:, None]


def per_layer(a: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """``a`` (rows, C) with one scale per channel from ``amax`` (C,), the channel's amax over a larger set of rows
    that holds ``a``'s (the recipe's rounding: ``amax`` appended as a row, so that it is each group's amax, and
    dropped after), e4m3 and back in float64: (C, rows)."""
    q, s = reference.quantize_groups(torch.cat([a.float(), amax.float()[None]]).t())
    return (q.double() * s.double()[:, None])[:, :-1]


def per_block(a: torch.Tensor) -> torch.Tensor:
    """``a`` (rows, C) with one scale per 128 rows x 128 channels from its first row (C a multiple of 128; rows past
    the last padded with zeros, as the recipe's groups), e4m3 and back in float64: (C, rows)."""
    rows, c = a.shape
    g = reference.FP8_GROUP
    tiles = -(-rows // g)
    padded = a.float().new_zeros(tiles * g, c)
    padded[:rows] = a.float()
    blocks = padded.reshape(tiles, g, c // g, g).transpose(1, 2)  # (tiles, C/128, 128 rows, 128 channels)
    q, s = reference.quantize_groups(blocks.reshape(tiles, c // g, g * g))
    deq = q.double() * s.double()[..., None]
    return deq.reshape(tiles, c // g, g, g).transpose(1, 2).reshape(tiles * g, c)[:rows].t()


def wgrad_errors(a: torch.Tensor, b: torch.Tensor, b_layer_amax: torch.Tensor) -> dict[str, float]:
    """The relative error of aᵀ b under each of ``SCALINGS`` (a's scaling / b's); ``b_layer_amax`` (C,): each of b's
    channels' amax over the layer's rows (``tile/layer``)."""
    ref = a.double().t() @ b.double()
    out = {"tile/tile": per_tile(a) @ per_tile(b).t(), "tile/expert": per_tile(a) @ per_expert(b).t(),
           "expert/expert": per_expert(a) @ per_expert(b).t(),
           "tile/layer": per_tile(a) @ per_layer(b, b_layer_amax).t(), "tile/block": per_tile(a) @ per_block(b).t()}
    return {name: float((dw - ref).norm() / ref.norm()) for name, dw in out.items()}


def operands(kind: str, rows: int, cols: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Two (rows, cols) bf16 operands of one distribution (see the module docstring)."""
    def one():
        if kind == "normal":
            return torch.randn(rows, cols, generator=gen)
        if kind == "outlier rows":
            v = torch.randn(rows, cols, generator=gen)
            v[torch.randperm(rows, generator=gen)[:max(1, rows // 100)]] *= 100.0
            return v
        if kind == "student-t(2)":
            return torch.randn(rows, cols, generator=gen) / torch.sqrt(torch.randn(rows, cols, 2, generator=gen)
                                                                       .square().mean(dim=-1))
        raise ValueError(kind)

    return one().to(torch.bfloat16), one().to(torch.bfloat16)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m tools.fp8_wgrad_scales", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rows", type=int, default=1024, help="the expert's rows (tokens routed to it)")
    p.add_argument("--cols", type=int, default=256, help="P = Q, channels of each operand")
    p.add_argument("--layer-rows", type=int, default=None,
                   help="the layer's rows, the expert's among them (tile/layer); default 16 x --rows (top-8 of 128 "
                        "experts: an expert gets a sixteenth of the tokens on average)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    layer_rows = args.layer_rows or 16 * args.rows
    if layer_rows < args.rows:
        p.error(f"--layer-rows ({layer_rows}) must be at least --rows ({args.rows})")
    gen = torch.Generator().manual_seed(args.seed)
    layer_gen = torch.Generator().manual_seed(args.seed + 1)
    print(f"dW = aᵀ b relative error, {args.rows} rows of {layer_rows}, {args.cols} x {args.cols}, seed {args.seed}")
    print(f"{'data':16s}" + "".join(f"{name:>16s}" for name in SCALINGS))
    for kind in KINDS:
        a, b = operands(kind, args.rows, args.cols, gen)
        # the layer's other rows from a generator of their own, so that a and b are those of the other columns' runs
        others = operands(kind, layer_rows - args.rows, args.cols, layer_gen)[1] if layer_rows > args.rows else b[:0]
        errors = wgrad_errors(a, b, torch.cat([b, others]).float().abs().amax(dim=0))
        print(f"{kind:16s}" + "".join(f"{errors[name]:16.3e}" for name in SCALINGS))


if __name__ == "__main__":
    main()
