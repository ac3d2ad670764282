"""lamina's layers: one module per family, each layer written once for every backend."""
from .attention import MultiheadAttention
from .base import REGISTRY, Layer, register
from .costs import BCEWithLogits, SoftmaxCrossEntropy, SquareError
from .conv import Conv2d, Conv3d, ConvTranspose2d, ConvTranspose3d
from .dense import Activation, Add, Bias, Concat, Dropout, Linear, Multiply, PReLU, Scale
from .shape import Broadcast, Reshape, Slice, Transpose
from .recurrent import GRU, LSTM, RNN
from .resize import Pad, Reduce, Resize
from .select import Compare, Where
from .selective import SelectedCrossEntropy, SelectiveLinear, SelfNormalizedCost
from .normalization import LayerNorm, RMSNorm
from .sequence import Embedding, PositionalEmbedding, SequencePool, SequenceSoftmax
from .transformer import TransformerEncoder, TransformerEncoderLayer
from .volume import AvgPool2d, AvgPool3d, BatchNorm2d, BatchNorm3d, ConcatChannels, MaxPool2d, MaxPool3d

__all__ = ["REGISTRY", "Layer", "register", "Linear", "Add", "Concat", "Activation", "Dropout",
           "Scale", "Reshape", "Bias", "Multiply", "Broadcast", "PReLU", "Slice", "Transpose", "SoftmaxCrossEntropy", "SquareError", "BCEWithLogits", "RNN", "LSTM", "GRU",
           "Embedding", "SequencePool", "SequenceSoftmax", "Conv3d", "Conv2d", "ConvTranspose3d",
           "ConvTranspose2d", "MaxPool3d", "MaxPool2d", "AvgPool3d", "AvgPool2d", "BatchNorm3d",
           "BatchNorm2d", "ConcatChannels", "Compare", "Where", "Pad", "Reduce", "Resize", "SelectiveLinear", "SelectedCrossEntropy", "SelfNormalizedCost",
           "MultiheadAttention", "LayerNorm", "RMSNorm", "PositionalEmbedding", "TransformerEncoderLayer",
           "TransformerEncoder"]
