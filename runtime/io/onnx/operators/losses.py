"""ONNX's SoftmaxCrossEntropyLoss as lamina's per-row cost."""
from .... import layers as L
from ....graph import Value
from ..registry import Refused, converter, text, value


@converter("SoftmaxCrossEntropyLoss", attributes={"reduction", "ignore_index"})
def softmax_cross_entropy_loss(imp, node, inputs, attrs):
    """With reduction 'none': one negative log-likelihood per row (per step of a sequence), the
    classes on axis 1; lamina's SoftmaxCrossEntropy as a score (objective=False), since a model
    file's output is something inference computes. An ignore_index outside the class range
    (PyTorch's -100) is taken: lamina refuses such a label at run time, naming the row, where
    ONNX gives that row 0."""
    reduction = text(attrs, "reduction", "mean")
    if reduction != "none":
        raise Refused(f"reduction '{reduction}' (a loss over the batch); lamina imports the per-row values, "
                      f"reduction 'none'")
    if len(inputs) > 2 and inputs[2] is not None:
        raise Refused("class weights")
    if len(node.output) > 1 and node.output[1] and imp.uses.get(node.output[1]):
        raise Refused("the log_prob output is used")
    x = inputs[0]
    if not isinstance(x, Value) or x.spec.kind != "float" or len(x.spec.shape) != 1:
        raise Refused("the scores must be float values computed from the model's inputs, [N, classes] or a "
                      "sequence's [N, classes, T]")
    classes_second = ("N", 0, "T") if x.spec.sequence else ("N", 0)
    if imp.axes_of(x) != classes_second:
        raise Refused(f"the scores' axes are {imp.axes_of(x)}; the classes must be axis 1")
    ignore = attrs.get("ignore_index")
    if ignore is not None and 0 <= ignore < x.spec.shape[0]:
        raise Refused(f"ignore_index {ignore}, a class (rows of that class would score 0)")
    labels = value(inputs[1], "input 1 (the labels)", kind="int32")
    return [imp.add(L.SoftmaxCrossEntropy(objective=False), [x, labels], node)]
