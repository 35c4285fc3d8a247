"""Compile the GEMM kernels for Hopper (sm_90a) on any machine — no GPU needed — and report registers,
spills and shared memory from ``ptxas -v``: the first things to check before spending device time.

``python -m tools.resources [--candidates]``; with 16-bit operands also the Gluon kernels
(``kernels.gluon_sm90``), whose pointer-store epilogues must emit 16-byte stores. Pointers and the D / I / P / Q sizes are
specialised as 16-divisible, as Triton does at run time for such values: without that Triton neither
vectorises nor pipelines the loads, and the report would describe a kernel that never runs. TMA
descriptor parameters (those the kernel's ``blocks`` names) get the block shape the config gives them.
Then the Gluon kernels with the sizes not so specialised (run time for D = 520, say) and the kernels
without a tile config (the backward's row copies, the expert-parallel protocol's kernels) are compiled too
(no report: they must compile).
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from megamoe.kernels import expert_bwd, expert_fwd, grads, quant
from megamoe.kernels import gluon_fp8_sm90 as ws8
from megamoe.kernels import gluon_sm90 as ws
from megamoe.kernels.tuning import TunedKernel, fit_dtype
from megamoe.parallel import owner, protocol, senders

HOPPER = GPUTarget("cuda", 90, 32)
SHARED_MEMORY_LIMIT = ws8.SHARED_MEMORY_LIMIT  # bytes per block on the H200 (sm_90)
KERNELS = {"up": expert_fwd.UP, "down": expert_fwd.DOWN, "dh": expert_bwd.DH, "act": expert_bwd.ACT_BWD,
           "dx": expert_bwd.DX, "wgrad": expert_bwd.WGRAD, "down_peer": owner.DOWN_PEER, "dx_peer": owner.DX_PEER,
           "send_up": owner.SEND_UP, "send_dh": owner.SEND_DH}
# Variants of a kernel above compiled at its default config with other constexpr knobs: the up kernels of the
# saved-activation mode (one GPU, and the expert-parallel owner's), which also store the gate/up products.
VARIANTS = {"up_saved": (expert_fwd.UP, {"SAVE_PREACT": True}), "send_up_saved": (owner.SEND_UP, {"SAVE_PREACT": True})}
# The blockwise FP8 variants (the Triton path, where the Gluon FP8 kernels do not run): operands e4m3, scales fp32,
# outputs and saved products bf16.
FP8_KERNELS = {"up_fp8": expert_fwd.UP_FP8, "down_fp8": expert_fwd.DOWN_FP8, "dh_fp8": expert_bwd.DH_FP8,
               "dx_fp8": expert_bwd.DX_FP8, "wgrad_fp8": expert_bwd.WGRAD_FP8}
# The Gluon FP8 kernels as their launchers compile them: (report name, ``gluon_fp8_sm90.KERNELS`` name, variant).
FP8_WS_VARIANTS = (("fp8_rows_ws", "fp8_rows", {}), ("fp8_up_ws", "fp8_up", {}), ("fp8_up_ws", "fp8_up", {"preact": True}),
                   ("fp8_wgrad_ws", "fp8_wgrad", {}), ("fp8_up_ws", "fp8_up", {"preact": True, "h_out": False}),
                   # blocks of 256 columns, the launchers' default where N / Q allow (ROWS_BLOCK_N, WGRAD_BLOCK_N)
                   ("fp8_rows_ws", "fp8_rows", {"block_n": 256}), ("fp8_wgrad_ws", "fp8_wgrad", {"block_n": 256}),
                   # an expert-parallel owner's: rows to their sources' slots (the down projection, dx)
                   ("fp8_rows_ws", "fp8_rows", {"block_n": 256, "row_dest": True}),
                   ("fp8_rows_ws", "fp8_rows", {"block_n": 256, "row_dest": True, "weighted": False}))
_FP8_POINTER_TYPES = {"out_ptr": "*bf16", "preact_ptr": "*bf16", "a_scale_ptr": "*fp32", "w_scale_ptr": "*fp32",
                      "x_scale_ptr": "*fp32", "h_scale_ptr": "*fp32", "b_scale_ptr": "*fp32"}
_POINTER_TYPES = {"weights_ptr": "*fp32", "dweight_part_ptr": "*fp32", "row_slot_ptr": "*i32",
                  "offsets_ptr": "*i32", "tile_expert_ptr": "*i32", "tile_row_ptr": "*i32",
                  "scalar_ptr": "*fp32", "recv_meta_ptr": "*i32", "arrived_ptr": "*i32", "counts_ptr": "*i32",
                  "epoch_ptr": "*i32", "recv_row_slot_ptr": "*i32", "recv_offsets_ptr": "*i32",
                  "recv_weight_ptr": "*fp32", "send_list_ptr": "*i32", "slot_row_ptr": "*i32",
                  "topk_idx_ptr": "*i64", "recv_token_row_ptr": "*i32", "row_map_ptr": "*i32", "trace_ptr": "*i64",
                  "ready_ptr": "*i64", "peers_ptr": "*i64", "x_s_ptr": "*fp32", "xq_ptr": "*fp8e4nv",
                  "by_size_ptr": "*i32", "counter_ptr": "*i32", "amax_ptr": "*fp32", "t_ptr": "*bf16",
                  "scale_ptr": "*fp32"}
_DIVISIBLE_INTS = {"D", "I", "P", "Q", "N_OUT", "K"}
_EXTRA_CONSTEXPRS = {"PREC": "tf32", "TILE_M": 128, "PART_COLS": 64, "EVEN_K": True, "TRACE": False, "SAVE_PREACT": False,
                     # the EP sending programs: 16 of them, 128 experts (64 per rank), top-8, D = 2048
                     "SENDERS": 16, "LB": 64, "EB": 128, "CB": 128}
# ... and their blocks, as the launchers pass them (at D = 2048 BD is the launcher's cap)
_SENDER_BLOCKS = {owner.SEND_UP: {"RB": senders.SEND_UP_ROWS, "BD": senders.SEND_UP_COLS},
                  owner.SEND_DH: {"RB": senders.SEND_DH_ROWS, "BD": senders.SEND_DH_COLS}}


def compile_for_hopper(kernel: TunedKernel, config: dict, dtype: str = "bf16", pointer_types: dict | None = None):
    """``dtype``: Triton name of the activation/weight element type (bf16, fp16, fp32, fp8e4nv); ``pointer_types``:
    the types of the pointers that differ from it (beyond the index and fp32 ones every kernel shares)."""
    pointer_types = {**_POINTER_TYPES, **(pointer_types or {})}
    fn = kernel.jit_fn
    blocks = kernel.blocks(config)
    extra = {**_EXTRA_CONSTEXPRS, **_SENDER_BLOCKS.get(kernel, {})}
    signature, attrs, constexprs = {}, {}, {}
    for i, param in enumerate(fn.params):
        name = param.name
        if param.is_constexpr:
            signature[name] = "constexpr"
            constexprs[name] = (config[name] if name in config else kernel.constants.get(
                name, extra.get(name, param.default if param.has_default else None)))
            if name == "PREC" and dtype == "fp32":
                constexprs[name] = "ieee"
            continue
        if name in blocks:  # a TMA descriptor
            block = ", ".join(map(str, blocks[name]))
            signature[name] = f"tensordesc<{dtype}[{block}]>"
            continue
        is_ptr = name.endswith(("_ptr", "_src"))  # *_src: a pointer where the config gives it no TMA block
        signature[name] = pointer_types.get(name, "*" + dtype) if is_ptr else "i32"
        if is_ptr or name in _DIVISIBLE_INTS:
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=signature, attrs=attrs, constexprs=constexprs)
    return triton.compile(src, target=HOPPER,
                          options={"num_warps": config["num_warps"], "num_stages": config["num_stages"]})


def resources(kernel: TunedKernel, config: dict, dtype: str = "bf16") -> dict:
    """Registers per thread, spill bytes (stores), shared memory and whether the MMAs are Hopper's
    warpgroup MMAs (bf16/fp16 should be; fp32 'ieee' dots are not), for one config on sm_90a."""
    return ptxas_report(compile_for_hopper(kernel, config, dtype))


def ptxas_report(compiled) -> dict:
    """``resources``' figures of one compiled kernel; ``wgmma_serialized``: ptxas made every warpgroup MMA wait for
    the one before (C7514 and kin: a kernel that keeps MMAs in flight while it reads registers loses that)."""
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(compiled.asm["ptx"])
        report = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", os.devnull], capture_output=True,
                                text=True, check=True).stderr
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    spills = re.search(r"(\d+) bytes spill stores", report)
    return {"registers": registers, "spill_bytes": int(spills.group(1)) if spills else 0,
            "shared_bytes": compiled.metadata.shared, "wgmma": "wgmma.mma_async" in compiled.asm["ptx"],
            # 16-byte pointer stores or TMA stores (shared memory to global)
            "wide_stores": "st.global.v4" in compiled.asm["ptx"] or ".global.shared::cta" in compiled.asm["ptx"],
            "wgmma_serialized": "wgmma.mma_async instructions are serialized" in report}


# The Gluon kernels (``kernels.gluon_sm90``) by report name, each with the Triton kernel (``KERNELS``) it replaces, its
# tile and its launch's register cap; the weight-gradient kernel twice, as the layer runs it: for dW2 (no tokens
# to combine, one slot: the combine partition idles) and for dW13 (the dx combine beside its MMAs, top-8).
WS_KERNELS = {"wgrad_ws": ("wgrad", ws.WGRAD_TILE, ws.WS_MAXNREG),
              "wgrad_combine_ws": ("wgrad", ws.WGRAD_TILE, ws.WS_MAXNREG),
              "dh_ws": ("dh", ws.WS_TILE, ws.WS_MAXNREG), "act_ws": ("act", ws.ACT_TILE, ws.ACT_MAXNREG),
              "up_ws": ("up", ws.UP_TILE, ws.WS_MAXNREG), "up_saved_ws": ("up_saved", ws.UP_TILE, ws.WS_MAXNREG)}


def compile_ws(name: str, dtype: str = "bf16", sizes_divisible: bool = True, top_k: int = 8, trace: bool = False,
               by_size: bool | None = None, taken: bool | None = None):
    """The Gluon kernel ``name`` of ``WS_KERNELS`` for sm_90a at its tile, with 16-bit operands (``dtype`` bf16
    or fp16), pointers and the D / I / P / Q sizes specialised as 16-divisible as at run time, 128 experts.
    ``sizes_divisible=False``: the sizes not so specialised, as at run time for sizes such as D = 520.
    ``top_k``: the slots per token of the side copies (``dh_ws``, ``wgrad_combine_ws``); ``trace``: the
    block-traced variant (``gluon_sm90.TRACE_BLOCKS``); ``by_size``: the weight gradients' blocks in order of their
    experts' rows (None: ``gluon_sm90.WGRAD_BY_SIZE``); ``taken``: those blocks taken in turn (None: as the layer's
    dW13 takes them, ``gluon_sm90.WGRAD_TAKEN``)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    _, (bm, bn, bk, stages), maxnreg = WS_KERNELS[name]
    element = {"bf16": gl.bfloat16, "fp16": gl.float16}[dtype]

    def desc(block):
        layout = gl.NVMMASharedLayout.get_default_for(block, element)
        return f"tensordesc<{dtype}[{', '.join(map(str, block))}],{layout}>"

    constexprs = {"STAGES": stages, "TRACE": trace, "num_warps": ws.WS_NUM_WARPS}
    if name in ("wgrad_ws", "wgrad_combine_ws"):
        fn, blocks = ws.KERNELS["wgrad"], {"a_desc": [bk, bm], "b_desc": [bk, bn], "dw_desc": [1, bm, bn]}
        combine = name == "wgrad_combine_ws"
        taken = "dw13" in ws.WGRAD_TAKEN if taken is None else taken
        constexprs.update(TOP_K=top_k if combine else 1, TAKEN=taken,
                          BY_SIZE=taken or (ws.WGRAD_BY_SIZE if by_size is None else by_size))
    elif name == "dh_ws":  # the x copy beside the MMAs, of top_k slots per token
        fn, blocks = ws.KERNELS["dh"], {"a_desc": [bm, bk], "w_desc": [1, bk, bn]}
        constexprs.update(EB=128, TILE_M=bm, TOP_K=top_k)
    elif name == "act_ws":
        fn, blocks = ws.KERNELS["act"], {"x_desc": [bm, bk], "w13_desc": [1, 1, bn, bk]}
        constexprs.update(EB=128, TILE_M=bm, PART_COLS=expert_bwd.PART_COLS, EPILOGUE_WARPS=ws.ACT_EPILOGUE_WARPS,
                          EPILOGUE_REGS=ws.ACT_EPILOGUE_REGS)
    else:
        fn, blocks = ws.KERNELS["up"], {"w13_desc": [1, 1, bn, bk]}
        constexprs.update(EB=128, TILE_M=bm, BK=bk, LOADER_WARPS=ws.UP_LOADER_WARPS, SAVE_PREACT=name == "up_saved_ws")

    def arg_type(arg):  # the rest typed as for the Triton kernels (compile_for_hopper): pointers by name, else i32
        if arg in blocks:
            return desc(blocks[arg])
        if arg in constexprs:
            return "constexpr"
        return _POINTER_TYPES.get(arg, f"*{dtype}") if arg.endswith("_ptr") else "i32"

    signature = {arg: arg_type(arg) for arg in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(fn.arg_names)
             if arg.endswith("_ptr") or (sizes_divisible and arg in _DIVISIBLE_INTS)}
    src = GluonASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=HOPPER, options={"num_warps": ws.WS_NUM_WARPS, "maxnreg": maxnreg})


def report_row(name: str, cfg: str, r: dict, too_big: list[str]) -> None:
    """Print one kernel's ``resources`` figures as a table row; note it in ``too_big`` if it needs more
    shared memory than the H200 has."""
    print(f"{name:10s} {cfg:52s} {r['registers']:5d} {r['spill_bytes']:8d} {r['shared_bytes'] / 1024:9.0f} "
          f"{'yes' if r['wgmma'] else 'no':>6s}", flush=True)
    if r["shared_bytes"] > SHARED_MEMORY_LIMIT:
        too_big.append(f"{name} {cfg}")


def configs_to_check(kernel: TunedKernel, candidates: bool) -> list[dict]:
    """The kernel's default config, and its autotuning candidates if ``candidates``; a kernel that follows its
    twin's choice (``TunedKernel.follows``) with a launch-mode knob, also its default in the other mode: the
    twin may choose either."""
    checked = [kernel.default, *(kernel.candidates if candidates else [])]
    if kernel.follows is not None and "PERSISTENT" in kernel.default:
        checked.append({**kernel.default, "PERSISTENT": not kernel.default["PERSISTENT"]})
    return checked


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m tools.resources", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--candidates", action="store_true", help="also every autotuning candidate")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16",
                   help="operand type (fp32 applies the launchers' halved BK)")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: the interpreter replaces the kernels this compiles")
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    print(f"{'kernel':10s} {'config':52s} {'regs':>5s} {'spill B':>8s} {'smem KiB':>9s} {'wgmma':>6s}")
    too_big = []
    for name, kernel in KERNELS.items():
        for config in configs_to_check(kernel, args.candidates):
            config = fit_dtype(config, torch_dtype)
            report_row(name, " ".join(f"{k}={v}" for k, v in config.items()), resources(kernel, config, args.dtype),
                       too_big)
    for name, (kernel, knobs) in VARIANTS.items():
        config = fit_dtype({**kernel.default, **knobs}, torch_dtype)
        report_row(name, " ".join(f"{k}={v}" for k, v in config.items()), resources(kernel, config, args.dtype),
                   too_big)
    narrow = []
    for name, (_, (bm, bn, bk, stages), maxnreg) in WS_KERNELS.items() if args.dtype != "fp32" else ():  # 16-bit only
        r = ptxas_report(compile_ws(name, args.dtype))
        report_row(name, f"BM={bm} BN={bn} BK={bk} STAGES={stages} num_warps={ws.WS_NUM_WARPS} "
                   f"maxnreg={maxnreg}", r, too_big)
        if not r["wide_stores"]:
            narrow.append(name)
    for name, kernel in FP8_KERNELS.items() if args.dtype == "bf16" else ():  # FP8 with bf16 outputs
        config = kernel.default
        report_row(name, " ".join(f"{k}={v}" for k, v in config.items()),
                   ptxas_report(compile_for_hopper(kernel, config, "fp8e4nv", _FP8_POINTER_TYPES)), too_big)
    for name, kernel, variant in FP8_WS_VARIANTS if args.dtype == "bf16" else ():
        r = ptxas_report(ws8.aot_compile(kernel, **variant))
        report_row(name, f"BM={ws8.FP8_BM} BN={variant.get('block_n', ws8.FP8_BN)} BK={ws8.FP8_BK} "
                   f"maxnreg={ws8.FP8_MAXNREG} " + " ".join(f"{k}={v}" for k, v in variant.items() if k != "block_n"),
                   r, too_big)
        if not r["wide_stores"]:
            narrow.append(name)
        if r["wgmma_serialized"]:
            raise SystemExit(f"{name} {variant}: ptxas serialises its warpgroup MMAs")
    for pow2 in (False, True) if args.dtype == "bf16" else ():  # the FP8 weight gradients' act step
        r = ptxas_report(ws8.aot_compile("fp8_act", pow2=pow2))
        report_row("fp8_act", f"BM={ws8.ACT_BM} num_warps={ws8.ACT_WARPS} pow2={pow2}", r, too_big)
        # two programs per SM, as it was timed: registers and shared memory for both
        two_fit = 2 * r["registers"] * 32 * ws8.ACT_WARPS <= 65536 and 2 * r["shared_bytes"] <= SHARED_MEMORY_LIMIT
        if r["spill_bytes"] or not two_fit:
            raise SystemExit(f"fp8_act (pow2={pow2}) spills or fits one program per SM: {r}")
    if narrow:  # 4-byte stores cost the first Gluon sorted-rows kernel 3-23% (docs/PERFORMANCE.md)
        raise SystemExit("Gluon kernels without 16-byte global stores: " + ", ".join(narrow))
    if too_big:
        raise SystemExit("over the shared-memory limit: " + "; ".join(too_big))
    for name in WS_KERNELS if args.dtype != "fp32" else ():  # the shapes api.fused_supports admits, D = 520 say
        compile_ws(name, args.dtype, sizes_divisible=False)
        print(f"{name} with sizes not 16-divisible: compiles", flush=True)
        if spill := ptxas_report(compile_ws(name, args.dtype, trace=True))["spill_bytes"]:  # tools.kernels_trace's
            raise SystemExit(f"{name} with its block trace spills {spill} bytes")
        print(f"{name} with its block trace: compiles without spills", flush=True)
        if name.startswith("wgrad"):  # the blocks' other order (gluon_sm90.WGRAD_BY_SIZE)
            other = not ws.WGRAD_BY_SIZE
            if spill := ptxas_report(compile_ws(name, args.dtype, by_size=other))["spill_bytes"]:
                raise SystemExit(f"{name} with by_size={other} spills {spill} bytes")
            print(f"{name} with by_size={other}: compiles without spills", flush=True)
            taken = "dw13" not in ws.WGRAD_TAKEN  # the blocks' other way (gluon_sm90.WGRAD_TAKEN)
            if spill := ptxas_report(compile_ws(name, args.dtype, taken=taken))["spill_bytes"]:
                raise SystemExit(f"{name} with taken={taken} spills {spill} bytes")
            print(f"{name} with taken={taken}: compiles without spills", flush=True)
    for name, top_k in itertools.product(("dh_ws", "wgrad_combine_ws") if args.dtype != "fp32" else (), (1, 2)):
        # a side copy moves more items per pass at small top_k (gluon_sm90._items_per_pass): within its registers
        if spill := ptxas_report(compile_ws(name, args.dtype, top_k=top_k))["spill_bytes"]:
            raise SystemExit(f"{name} at top_k={top_k} spills {spill} bytes")
        print(f"{name} at top_k={top_k}: compiles without spills", flush=True)
    for fn in OTHER_KERNELS:
        compile_other_kernel(fn)
        print(f"{fn.__name__}: compiles", flush=True)
    compile_other_kernel(senders._dispatch_rows_kernel, pointer_types={"x_ptr": "*fp8e4nv"}, HAS_DY=False,
                         X_SCALES=True, ROWS=False)
    print("_dispatch_rows_kernel with FP8 rows and their scales (the slots' fields): compiles", flush=True)
    compile_other_kernel(senders._dispatch_rows_kernel, HAS_DY=True, X_SCALES=True, ROWS=False)
    print("_dispatch_rows_kernel with the backward's FP8 token rows beside x and dy once per token: compiles",
          flush=True)
    compile_other_kernel(senders._send_token_rows_kernel, HAS_DY=True, X_SCALES=True, BD=512)
    print("_send_token_rows_kernel with the backward's FP8 token rows beside x and dy: compiles", flush=True)
    act = expert_bwd.ACT_FROM_PREACT.default
    for quant_dz in (False, True):  # the act step on saved products at its default config, bf16 and FP8 paths
        compiled = compile_other_kernel(expert_bwd._act_from_preact_kernel, num_warps=act["num_warps"],
                                        BM=act["BM"], BN=act["BN"], QUANT_DZ=quant_dz, POW2=quant_dz)
        if spill := ptxas_report(compiled)["spill_bytes"]:  # (BM = 32 at 4 warps spilled 0.7-0.9 KB)
            raise SystemExit(f"the act step on saved products (QUANT_DZ={quant_dz}) spills {spill} bytes")
        print(f"act_from_preact with QUANT_DZ={quant_dz}: compiles without spills", flush=True)


# The kernels without a tile config: the backward's row copies, the expert-parallel protocol's kernels, the
# quantisers and the training loop's gradient scaling, checked to compile for sm_90a.
OTHER_KERNELS = (*expert_bwd.KERNELS, *protocol.KERNELS, *senders.KERNELS, *owner.KERNELS, *quant.KERNELS,
                 *grads.KERNELS)
_OTHER_CONSTEXPRS = {"HAS_DY": True, "HAS_B": True, "CARRIES": True, "RB": 16, "KB": 8, "EB": 128, "CB": 128, "BD": 256,
                     "LB": 16, "NB": 8, "TB": 16, "BLOCK": 1024,
                     # the bounded wait-and-reset of the write-backs (protocol.wait_returned)
                     "STAGE": 5, "PER": 1,
                     # the act kernel on saved products, at its launcher's block
                     "TILE_M": 128, "PART_COLS": expert_bwd.PART_COLS, "BM": expert_bwd.ACT_FROM_PREACT.default["BM"],
                     "BN": expert_bwd.ACT_FROM_PREACT.default["BN"], "QUANT_DZ": True,
                     # the backward's row copy with dy's quantisation (the FP8 path's)
                     "QUANT_B": True,
                     # the tile-column quantiser reading the tokens' rows (the FP8 weight gradients' x and dy), with
                     # the columns' amax given (x's scales per channel over the layer, autograd.FP8_WGRAD_X_SCALES)
                     "GATHER": True, "GIVEN_AMAX": True,
                     # the FP8 quantisers' power-of-two scales (env.set_fp8_scales)
                     "POW2": True,
                     # the forward's dispatch in bf16 (compiled with FP8 rows and their scales too, below)
                     "X_SCALES": False, "GB": 16,
                     # the owner's rows to their sources, through a row map (the loopback's round trip)
                     "ROW_MAP": True, "SCALAR": True,
                     # the owner's row destinations in 16-byte units of bf16 rows (owner.row_destinations)
                     "UNIT": 8,
                     # the backward's x and dy once per slot, copied in the slot walk (compiled without the rows
                     # too, the token-major kernel's companion, below)
                     "ROWS": True,
                     # the quantisers, at their launchers' blocks
                     "SLICE": quant.WEIGHT_SLICE, "BC": quant.TILE_COLS_BC,
                     # the weight quantiser writing both copies (the "step" cache's pass)
                     "STRAIGHT": True, "TRANSPOSED": True,
                     # the gradient scaling as the GPU runs it (the interpreter's bf16 rounding on the bits is off)
                     "ON_THE_BITS": False}


def compile_other_kernel(fn, num_warps: int = 4, pointer_types: dict | None = None, **constexprs_over):
    """``fn`` (one of ``OTHER_KERNELS``) for sm_90a with bf16 rows, 128 experts and D = 2048's block sizes (or the
    constexprs given; ``pointer_types``: other element types by argument name); pointers and D specialised as
    16-divisible, as at run time (without it the row copies compile to 2-byte loads that never run)."""
    signature, attrs, constexprs = {}, {}, {}
    for i, param in enumerate(fn.params):
        name = param.name
        if param.is_constexpr:
            signature[name], constexprs[name] = "constexpr", constexprs_over.get(name, _OTHER_CONSTEXPRS[name])
            continue
        if name.endswith("_ptr") and name in (pointer_types or {}):
            signature[name] = pointer_types[name]
        elif name.endswith("_ptr"):
            signature[name] = {"x_ptr": "*bf16", "dy_ptr": "*bf16", "rows_ptr": "*bf16", "a_ptr": "*bf16",
                               "b_ptr": "*bf16", "a_out_ptr": "*bf16", "b_out_ptr": "*bf16", "counter_ptr": "*i64",
                               "expected_ptr": "*i64", "preact_ptr": "*bf16", "dh_ptr": "*bf16", "dz_ptr": "*bf16",
                               "hw_ptr": "*bf16", "w_ptr": "*bf16", "q_ptr": "*fp8e4nv", "qt_ptr": "*fp8e4nv",
                               "dzq_ptr": "*fp8e4nv", "s_ptr": "*fp32", "st_ptr": "*fp32",
                               "dzs_ptr": "*fp32", "bq_ptr": "*fp8e4nv", "bs_ptr": "*fp32", "dest_ptr": "*i64",
                               }.get(name, _POINTER_TYPES.get(name, "*i32"))
        else:  # an address passed as an integer (``base``) is 64-bit
            signature[name] = "i64" if name == "base" else "i32"
        if name.endswith("_ptr") or name == "D":
            attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn=fn, signature=signature, attrs=attrs, constexprs=constexprs), target=HOPPER,
                          options={"num_warps": num_warps})


if __name__ == "__main__":
    main()
