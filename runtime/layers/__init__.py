"""lamina's layers: one module per family, each layer written once for every backend."""
from .base import REGISTRY, Layer, register
from .costs import BCEWithLogits, SoftmaxCrossEntropy, SquareError
from .dense import Activation, Add, Concat, Dropout, Linear, Scale
from .recurrent import GRU, LSTM, RNN
from .sequence import Embedding, SequencePool, SequenceSoftmax

__all__ = ["REGISTRY", "Layer", "register", "Linear", "Add", "Concat", "Activation", "Dropout",
           "Scale", "SoftmaxCrossEntropy", "SquareError", "BCEWithLogits", "RNN", "LSTM", "GRU",
           "Embedding", "SequencePool", "SequenceSoftmax"]
