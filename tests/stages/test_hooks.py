"""stages.hooks: the forward patches of sensitivity (replayed_layers) and Fisher (recomputed_layers) leave each
layer's forward as they found it -- including a forward accelerate set on the layer object under a device_map."""
import torch
from accelerate.hooks import ModelHook, add_hook_to_module

from stages.fisher import recomputed_layers
from stages.hooks import replayed_layers


class Counting(ModelHook):
    """An accelerate hook (what a device_map puts on every decoder layer), counting the forwards it wraps."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def pre_forward(self, module, *args, **kwargs):
        self.calls += 1
        return args, kwargs


def _layers():
    torch.manual_seed(0)
    layers = [torch.nn.Linear(3, 3) for _ in range(3)]
    hook = Counting()
    add_hook_to_module(layers[0], hook)  # layer 0 carries accelerate's forward, the others the class's
    return layers, hook


def test_replayed_layers_put_back_a_forward_set_on_the_layer():
    layers, hook = _layers()
    x, recorded = torch.ones(1, 3), [torch.full((1, 3), 7.0), torch.full((1, 3), 8.0)]
    with replayed_layers(layers, recorded, upto=2):
        assert torch.equal(layers[0](x), recorded[0]) and torch.equal(layers[1](x), recorded[1])
        assert hook.calls == 0  # replayed: nothing computed, accelerate's hook not reached
        assert torch.equal(layers[2](x), torch.nn.Linear.forward(layers[2], x))
    assert "forward" in layers[0].__dict__ and "forward" not in layers[1].__dict__
    assert torch.equal(layers[0](x), torch.nn.Linear.forward(layers[0], x)) and hook.calls == 1


def test_recomputed_layers_put_back_a_forward_set_on_the_layer():
    layers, hook = _layers()
    x = torch.ones(1, 3, requires_grad=True)
    with recomputed_layers(layers, enabled=True):
        y = layers[2](layers[1](layers[0](x))).sum()
        y.backward()  # layer 0 recomputed under checkpoint: accelerate's hook runs again
        assert hook.calls == 2
    assert all("forward" not in layer.__dict__ for layer in layers[1:])
    layers[0](x)
    assert hook.calls == 3  # still accelerate's forward after the block
