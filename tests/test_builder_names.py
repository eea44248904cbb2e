"""``set_interm`` names select exactly the fx node they name.

Names are the fx node names of a submodule (the paper: "we use the torch.fx tracer to
assign deterministic names"). At run time the calls used to be numbered by counting the
tensor calls seen, which drifts from fx's numbering: fx also numbers calls on shapes and
tuples, renames calls that shadow builtins (``sum_1``, ``pow_1``), has no node for
constants (``torch.ones(...).tril()``), and a branch not taken (``if mask is not None``)
shifts every later call. ``set_interm("add_1")`` then sparsified fx's ``add_2``, silently.
Each test compares with the dense model masked at the named fx node (values and
gradients), the mask passing gradients straight through as documented.
"""

import copy
import warnings

import pytest
import torch
import transformers

import sten_core as sten


class _Mask(torch.nn.Module):
    """Keeps what ``sparsifier`` keeps; the gradient passes straight through."""

    def __init__(self, sparsifier):
        super().__init__()
        self.sparsifier = sparsifier

    def forward(self, y):
        return y + (y * self.sparsifier.mask(y.detach()) - y).detach()


def _masked_at(module: torch.nn.Module, node_name: str, sparsifier) -> torch.fx.GraphModule:
    """The dense reference: ``module``'s fx graph with a mask after node ``node_name``."""
    gm = torch.fx.symbolic_trace(module)
    gm.add_submodule("_mask", _Mask(sparsifier))
    node = next(n for n in gm.graph.nodes if n.name == node_name)
    with gm.graph.inserting_after(node):
        masked = gm.graph.call_module("_mask", (node,))
    node.replace_all_uses_with(masked)
    masked.args = (node,)
    gm.recompile()
    return gm


def _dense(t):
    return t.to_dense() if isinstance(t, sten.SparseTensorWrapper) else t


def _compare(sparse_model, reference, *inputs):
    """Values, the inputs' gradients and every parameter's gradient agree."""
    def run(model):
        for p in model.parameters():
            p.grad = None
        xs = [x.clone().requires_grad_(True) for x in inputs]
        out = _dense(model(*xs))
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        return out.detach(), [x.grad for x in xs], grads

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sten.DispatchWarning)
        out, x_grads, p_grads = run(sparse_model)
    ref, ref_x_grads, ref_p_grads = run(reference)
    torch.testing.assert_close(out, ref)
    for got, want in zip(x_grads, ref_x_grads):
        torch.testing.assert_close(got, want)
    for name, got in p_grads.items():
        torch.testing.assert_close(_dense(got), ref_p_grads[name], msg=name)


def _sparse(model, name, sparsifier, out_format=torch.Tensor):
    sb = sten.SparsityBuilder(model)
    sb.set_interm(name, inline_sparsifier=sparsifier, out_format=out_format)
    return sb.get_sparse_model()


class Block(torch.nn.Module):
    """Shape arithmetic before the target (HF Conv1D and attention reshapes do this)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        out_shape = x.size()[:-1] + (2, 4)     # fx: size, getitem, add (on tuples)
        h = self.lin(x) + 1.0                  # fx: add_1
        h = torch.relu(h) + x                  # fx: relu, add_2
        return h.view(out_shape)


@pytest.mark.parametrize("out_format", [torch.Tensor, sten.CooTensor])
def test_custom_block_nodes_after_shape_arithmetic(out_format):
    torch.manual_seed(0)
    model, sp = Block(), sten.ScalarThresholdSparsifier(0.5)
    x = torch.randn(3, 8)
    for node in ("add_1", "relu", "add_2"):
        _compare(_sparse(model, node, sp, out_format), _masked_at(model, node, sp), x)


def _gpt2_config():
    return transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, n_positions=32, vocab_size=50,
                                   bos_token_id=0, eos_token_id=0, attn_implementation="eager",
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def test_gpt2_mlp_every_gelu_node():
    """GPT-2's MLP: HF ``Conv1D`` (size arithmetic) and ``NewGELUActivation`` (``torch.pow``:
    fx's ``pow_1``)."""
    torch.manual_seed(0)
    mlp = transformers.models.gpt2.modeling_gpt2.GPT2MLP(64, _gpt2_config()).eval()
    sp = sten.ScalarThresholdSparsifier(0.05)
    x = torch.randn(2, 5, 16)
    for node in ("mul", "pow_1", "mul_1", "add_1", "mul_2", "tanh", "add_2", "mul_3"):
        _compare(_sparse(mlp, node, sp, sten.CooTensor), _masked_at(mlp, node, sp), x)


def test_gpt2_model_intermediate_by_its_path():
    """The whole LM: ``transformer.h.0.mlp.add_1`` is ``x + 0.044715 * x**3`` in the MLP."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(_gpt2_config()).eval()
    sp = sten.ScalarThresholdSparsifier(0.05)
    sparse = _sparse(model, "transformer.h.0.mlp.add_1", sp, sten.CooTensor)
    reference = copy.deepcopy(model)
    reference.transformer.h[0].mlp = _masked_at(reference.transformer.h[0].mlp, "add_1", sp)
    ids = torch.randint(0, 50, (2, 7))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sten.DispatchWarning)
        out = sparse(ids).logits
        out.sum().backward()
    ref = reference(ids).logits
    ref.sum().backward()
    torch.testing.assert_close(out, ref)
    grads = dict(reference.named_parameters())
    for name, p in sparse.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, msg=name)


class Norm(torch.nn.Module):
    def forward(self, x):
        return x / x.abs().sum(-1, keepdim=True)     # fx: abs_1, sum_1, truediv


@pytest.mark.parametrize("node", ["abs_1", "sum_1", "truediv"])
def test_calls_fx_renames_for_builtins(node):
    """fx names ``abs``/``sum`` calls ``abs_1``/``sum_1`` (they shadow builtins)."""
    torch.manual_seed(0)
    model, sp = Norm(), sten.ScalarThresholdSparsifier(0.5)
    _compare(_sparse(model, node, sp), _masked_at(model, node, sp), torch.randn(3, 5))


class WithConstant(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        causal = torch.ones(4, 4).tril() + 1      # a constant: fx folds it, no node
        return torch.relu(self.lin(x) @ causal + 1)   # fx: matmul, add, relu


def test_constants_have_no_node():
    torch.manual_seed(0)
    model, sp = WithConstant(), sten.ScalarThresholdSparsifier(1.0)
    x = torch.randn(3, 4)
    sparse = {node: _sparse(model, node, sp) for node in ("matmul", "add")}
    assert not hasattr(model, "_tensor_constant0")    # tracing left the model as it was
    for node, sparse_model in sparse.items():
        _compare(sparse_model, _masked_at(model, node, sp), x)


class OptionalMask(torch.nn.Module):
    """``if mask is not None`` (HF attention does this): fx traces the branch."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(6, 6)

    def forward(self, x, mask=None):
        h = self.lin(x)
        if mask is not None:
            h = h + mask                 # fx: add
        return torch.relu(h) + x         # fx: relu, add_1


def _optional_mask_reference(model, x, mask, sp, at):
    def cut(t, name):
        return t * sp.mask(t) if name == at else t

    h = model.lin(x)
    if mask is not None:
        h = cut(h + mask, "add")
    return cut(cut(torch.relu(h), "relu") + x, "add_1")


def test_branch_not_taken_does_not_shift_names():
    """Without a mask, the run-time count called ``relu(h) + x`` "add": "add_1" was never produced."""
    torch.manual_seed(0)
    model, sp = OptionalMask(), sten.ScalarThresholdSparsifier(0.5)
    sparse = _sparse(model, "add_1", sp)
    x, mask = torch.randn(4, 6), torch.randn(4, 6)
    torch.testing.assert_close(sparse(x), _optional_mask_reference(model, x, None, sp, "add_1"))
    torch.testing.assert_close(sparse(x, mask), _optional_mask_reference(model, x, mask, sp, "add_1"))


def test_name_in_a_branch_not_taken_warns_and_sparsifies_when_taken():
    """"add" is in the branch: a call without a mask used to sparsify ``relu(h) + x`` instead."""
    torch.manual_seed(0)
    model, sp = OptionalMask(), sten.ScalarThresholdSparsifier(0.5)
    sparse = _sparse(model, "add", sp)
    x, mask = torch.randn(4, 6), torch.randn(4, 6)
    with pytest.warns(UserWarning, match=r"'add' \(fx node add\) was not produced by this forward"):
        out = sparse(x)
    torch.testing.assert_close(out, _optional_mask_reference(model, x, None, sp, None))
    with warnings.catch_warnings():
        warnings.simplefilter("error")      # reported once
        out = sparse(x, mask)
        torch.testing.assert_close(out, _optional_mask_reference(model, x, mask, sp, "add"))
        sparse(x)


class Gate(torch.nn.Module):
    """A data-dependent branch: fx cannot trace it (run-time names)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        if bool((h > 0).any()):
            h = torch.relu(h) * 2      # 'mul'
        return h


def test_untraceable_branch_skipped_on_the_first_call():
    """The first forward raised ValueError when it did not take the branch."""
    torch.manual_seed(0)
    model, sp = Gate(), sten.ScalarThresholdSparsifier(0.5)
    with torch.no_grad():
        model.lin.bias.fill_(-1000.0)          # the first batch does not take the branch
    sparse = _sparse(model, "mul", sp)
    x = torch.randn(2, 4)
    with pytest.warns(UserWarning, match="'mul' was not produced .* data-dependent branch"):
        out = sparse(x)
    torch.testing.assert_close(out, model(x))
    with torch.no_grad():
        model.lin.bias.zero_()
        sparse.lin.bias.zero_()
    h = torch.relu(model.lin(x)) * 2
    torch.testing.assert_close(sparse(x), h * sp.mask(h))


def test_node_on_tuples_is_not_a_tensor():
    """Block's ``add`` adds shape tuples: there is nothing to sparsify (it used to hit ``lin(x) + 1``)."""
    sparse = _sparse(Block(), "add", sten.ScalarThresholdSparsifier(0.5))
    with pytest.raises(ValueError, match="'add' is not a tensor operation"):
        sparse(torch.randn(3, 8))


def test_size_is_not_a_tensor():
    with pytest.raises(ValueError, match="'size' is not a tensor operation"):
        sten.SparsityBuilder(Block()).set_interm("size", inline_sparsifier=sten.ScalarThresholdSparsifier(0.5))


class _TrainingOnlyAdd(torch.nn.Module):
    """Training adds ``h + b`` before the output's ``+``: fx calls them ``add`` and ``add_1`` in
    training, while in eval the output's ``+`` alone is ``add``."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.register_buffer("b", torch.full((8,), 0.1))

    def forward(self, x):
        h = self.fc(x)
        if self.training:
            h = h + self.b
        return torch.relu(h) + torch.sigmoid(h)


@pytest.mark.parametrize("name, output_sparse", [("add", {True: False, False: False}),
                                                 ("add_1", {True: True, False: True})])
def test_a_name_means_the_same_call_in_training_and_in_eval(name, output_sparse):
    """Names were looked up in each mode's own graph: ``set_interm("add")`` sparsified the inner
    ``h + b`` in training and the module's output in eval, and ``add_1`` nothing in eval."""
    torch.manual_seed(0)
    builder = sten.SparsityBuilder(_TrainingOnlyAdd())
    builder.set_interm(name, inline_sparsifier=sten.ScalarFractionSparsifier(0.5), tmp_format=sten.CooTensor,
                       external_sparsifier=sten.KeepAll(), out_format=sten.CooTensor)
    model = builder.get_sparse_model()
    x = torch.randn(4, 8)
    for training in (True, False):
        model.train(training)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.no_grad():
                out = model(x)
        assert isinstance(out, sten.SparseTensorWrapper) is output_sparse[training], (name, training)
