"""The backend contract: the core kernels are all a backend must implement.

The reference backend stripped to the core set (lamina.testing.core_only) runs every composed
operation as Backend composes it. The kernel conformance tests hold it to the full reference
(conftest's BACKENDS), and here every layer runs on it and agrees with the CPU backend: the
OpenCL suite's layer tests, run unchanged with this backend as the device, and one network per
layer kind that those do not cover."""
import numpy as np
import pytest

import lamina as lm
from lamina.backends.base import CORE_KERNELS, Backend
from lamina.backends.cpu import CPUBackend
from lamina.backends.reference import ReferenceBackend
from lamina.parameter import host
from lamina.testing import core_only

import test_opencl as device_tests

# What a backend must implement: a change here is a change of the contract.
EXPECTED_CORE = {
    "empty", "fill", "from_host", "to_host", "copy",  # arrays
    "gemm",  # products
    "activation", "activation_backward", "axpby", "multiply", "bernoulli_mask", "select",  # element-wise
    "round_to_bfloat16", "quantize_rows",  # precisions
    "sum_squares", "channel_bias", "channel_bias_grad",  # reductions
    "batch_norm_stats", "stat_dtype", "batch_norm_statistics", "add_cast", "batch_norm_apply", "batch_norm_backward",
    "max_pool", "max_pool_backward", "avg_pool", "avg_pool_backward",
    "gather_rows", "scatter_rows", "scatter_add_rows",  # gathers and scatters
    "gather_entries", "scatter_entries", "selected_dots", "selected_backward", "selected_bias_grad",
    "segment_cross_entropy", "segment_cross_entropy_backward", "segment_self_normalized",
    "segment_self_normalized_backward",
    "sequence_pool", "sequence_pool_backward", "sequence_softmax", "sequence_softmax_backward",  # sequences
    "vol2col", "col2vol", "resample_axis", "resample_axis_backward",  # volumes
    "attention", "attention_backward", "layer_norm", "layer_norm_backward",  # transformers
    "lstm_step", "lstm_step_backward", "gru_step", "gru_step_backward",  # cells
    "sgd_update", "adam_update", "adagrad_update", "rmsprop_update",  # optimizer updates
}


def test_the_core_set_is_the_abstract_interface():
    assert CORE_KERNELS == EXPECTED_CORE


def backend_classes():
    classes = [CPUBackend, ReferenceBackend]
    if device_tests.FOUND:
        classes.append(device_tests.OpenCLBackend)
    return classes


@pytest.mark.parametrize("cls", backend_classes(), ids=lambda c: c.__name__)
def test_every_backend_implements_the_core_set(cls):
    assert not getattr(cls, "__abstractmethods__", frozenset())
    assert all(getattr(cls, name) is not getattr(Backend, name) for name in CORE_KERNELS)


def test_a_backend_missing_a_core_kernel_cannot_be_made():
    stripped = core_only(ReferenceBackend)
    incomplete = type("Incomplete", (Backend,), {k: v for k, v in vars(stripped).items() if k != "gather_rows"})
    with pytest.raises(TypeError, match="gather_rows"):
        incomplete()


def test_the_stripped_reference_composes_everything_else():
    stripped = core_only(ReferenceBackend)
    composed = [name for name, value in vars(Backend).items() if callable(value) and not name.startswith("_")
                and name not in CORE_KERNELS]
    assert len(composed) > 20
    for name in composed:
        assert getattr(stripped, name) is getattr(Backend, name), name
    for name in CORE_KERNELS:
        assert getattr(stripped, name) is getattr(ReferenceBackend, name), name


@pytest.fixture(scope="module")
def cl():
    """The device of the reused OpenCL layer tests: the core-only reference."""
    backend = core_only(ReferenceBackend)()
    backend.fp64 = True
    return backend


LAYER_TESTS = ["test_layers_agree_with_the_cpu", "test_training_from_one_start",
               "test_moving_keeps_results_and_optimizer_state", "test_batch_norm_agrees_with_the_cpu",
               "test_recurrent_layers_agree_with_the_cpu", "test_sequence_layers_agree_with_the_cpu",
               "test_sparse_row_updates_agree_with_the_cpu", "test_selective_layer_agrees_with_the_cpu",
               "test_convolutions_agree_with_the_cpu", "test_a_convolution_with_its_activation_fused_agrees_with_the_cpu",
               "test_pooling_agrees_with_the_cpu", "test_a_users_layer_written_against_the_interface_runs_on_opencl",
               "test_shipped_language_model_runs_on_the_device", "test_transformer_layers_agree_with_the_cpu"]
for _name in LAYER_TESTS:
    globals()[_name] = getattr(device_tests, _name)


@pytest.mark.slow  # the reference's vol2col is a Python loop: minutes for the denoiser's volumes
def test_shipped_denoiser_runs_on_the_device(cl):
    device_tests.test_shipped_denoiser_runs_on_the_device(cl)


def test_channel_concatenation_agrees_with_the_cpu(cl):
    """The one layer kind the tests above reach only through the shipped denoiser."""
    def build():
        lm.manual_seed(3)
        net = lm.Network()
        a, b = net.input("a", (2, 3, 4)), net.input("b", (3, 3, 4))
        net.outputs(y=lm.layers.ConcatChannels(name="cat")(lm.layers.Conv2d(2, 2, 3, padding=1)(a), b))
        for name in ("a", "b"):
            net.values[name].requires_grad = True
        return net
    rng = np.random.default_rng(0)
    feeds = {"a": rng.standard_normal((2, 2, 3, 4)).astype(np.float32),
             "b": rng.standard_normal((2, 3, 3, 4)).astype(np.float32)}
    cpu, dev = build(), build().to(cl)
    np.testing.assert_allclose(dev.run(feeds)["y"], cpu.run(feeds)["y"], rtol=1e-5, atol=1e-6)
    for net in (cpu, dev):
        net.forward(feeds, grad_outputs=["y"])
        net.backward(grad_outputs={"y": np.linspace(-1, 1, 120, dtype=np.float32).reshape(2, 5, 3, 4)})
    for name in ("a", "b"):
        np.testing.assert_allclose(host(dev.grad(name)), cpu.grad(name), rtol=1e-5, atol=1e-6)
