"""TunedKernel's launch paths (megamoe/kernels/tuning.py), on a one-line kernel. Triton's autotuner times
configs on a GPU only, so it is stubbed here by one that 'chooses' a fixed config; the GPU suite runs the
real one (tests/test_kernels.py::test_autotuned_configs_match_fp32_reference)."""

import torch
import triton
import triton.language as tl

from megamoe.kernels import tuning

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _fill_kernel(out_ptr, N, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """out[:N] = BN, BM elements per program: the launch's config shows in the output."""
    offs = tl.program_id(0) * BM + tl.arange(0, BM)
    tl.store(out_ptr + offs, tl.full((BM,), BN, tl.float32), mask=offs < N)


class _ChoosingAutotuner:
    """Stands in for ``triton.autotune``'s wrapper: counts its launches and, as the real one does after
    timing, runs the kernel once with the config it chose."""

    def __init__(self, kernel: tuning.TunedKernel, choice: dict):
        self.kernel, self.choice, self.launches = kernel, choice, 0

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.launches += 1
            self.best_config = tuning._triton_config(self.choice, None)
            self.kernel.jit_fn[grid(self.choice)](*args, **kwargs, **self.choice)

        return run


def test_autotunes_once_per_key_then_launches_the_choice(monkeypatch):
    kernel = tuning.TunedKernel(_fill_kernel, default=tuning.configs((16, 1, 1, 1, 1))[0],
                                candidates=tuning.configs((32, 2, 1, 1, 1)), key=["N"], even_k=None,
                                blocks=lambda c: {})
    choice = tuning.configs((32, 2, 1, 1, 1))[0]
    autotuner = _ChoosingAutotuner(kernel, choice)
    monkeypatch.setattr(kernel, "_tuned", autotuner)
    monkeypatch.setattr(tuning, "autotune_enabled", lambda dtype: True)
    grid = lambda c: (triton.cdiv(40, c["BM"]),)

    out = torch.zeros(40, device=DEVICE)
    kernel[grid](out, 40, dtype=torch.bfloat16)
    assert autotuner.launches == 1 and kernel.last_config == choice
    for _ in range(2):  # the tuned key: the chosen config, launched without the autotuner
        out.zero_()
        kernel[grid](out, 40, dtype=torch.bfloat16)
        assert autotuner.launches == 1 and kernel.last_config == choice
        assert torch.equal(out, torch.full_like(out, 2.0))  # BN = 2 and BM = 32: both programs ran
    kernel[grid](out, 24, dtype=torch.bfloat16)  # a new key tunes again
    kernel[grid](out, 40, dtype=torch.float16)  # so does a new dtype
    assert autotuner.launches == 3


def test_every_tuned_kernels_configs_name_only_its_own_parameters():
    """Each config the autotuner may launch (the default and every candidate) passes only arguments its kernel
    takes: Triton rejects an unknown keyword at launch, and the candidates launch only when autotuning is on (on a
    GPU, never in the interpreter)."""
    import importlib
    import pkgutil

    import megamoe.kernels

    kernels = []
    for info in pkgutil.iter_modules(megamoe.kernels.__path__):
        module = importlib.import_module(f"megamoe.kernels.{info.name}")
        kernels += [(f"{info.name}.{name}", obj) for name, obj in vars(module).items()
                    if isinstance(obj, tuning.TunedKernel)]
    assert len(kernels) > 5
    for name, kernel in kernels:
        params = set(kernel.jit_fn.arg_names)
        for config in kernel._tuned.configs:
            assert set(config.kwargs) <= params, (name, set(config.kwargs) - params)


def test_a_kernel_writing_over_its_input_has_autotuning_put_it_back():
    """The act step from saved products may write dz over them (``expert_bwd.act_bwd_from_preact``): its autotuner
    restores them after every trial, else the trials after the first, and the final launch, would read dz as the
    products (tests/test_kernels.py::test_autotuned_configs_match_fp32_reference runs it on the GPU)."""
    from megamoe.kernels.expert_bwd import ACT_FROM_PREACT

    assert ACT_FROM_PREACT._tuned.restore_value == ["preact_ptr"]
    assert "preact_ptr" in ACT_FROM_PREACT.jit_fn.arg_names
