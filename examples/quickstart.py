"""The README example: build a network, train it a few steps, save it, load it, run inference.

Data: two interleaved spirals (a classic that a linear model cannot separate), made here.
"""
import os
import tempfile

import numpy as np

import lamina as lm
from lamina.layers import Dropout, Linear, SoftmaxCrossEntropy


def spirals(n, rng):
    t = rng.uniform(0.25, 3.0, n) * np.pi
    label = rng.integers(0, 2, n)
    angle = t + np.pi * label
    xy = np.stack([t * np.cos(angle), t * np.sin(angle)], 1) / 10 + rng.normal(0, 0.02, (n, 2))
    return xy.astype(np.float32), label.astype(np.int32)


def main():
    lm.manual_seed(0)
    rng = np.random.default_rng(0)
    x_train, y_train = spirals(2048, rng)
    x_test, y_test = spirals(512, rng)

    # build: 2 -> 64 -> 64 -> 2 with ReLU and dropout, softmax cross-entropy on integer labels
    net = lm.Network()
    x = net.input("x", 2)
    y = net.input("y", dtype="int32")
    h = Linear(2, 64, activation="relu")(x)
    h = Dropout(0.1)(Linear(64, 64, activation="relu")(h))
    logits = Linear(64, 2)(h)
    net.outputs(loss=SoftmaxCrossEntropy()(logits, y), logits=logits)
    print(net.summary())

    # train: Adam with a cosine schedule; each parameter updates as soon as its gradient is complete
    steps, batch = 600, 128
    opt = lm.optim.Adam(net, lr=0.01, schedule=lm.optim.CosineWarmup(warmup=30, total=steps))
    for step in range(steps):
        idx = rng.integers(0, len(x_train), batch)
        loss = net.train_step({"x": x_train[idx], "y": y_train[idx]}, opt)
        if step % 100 == 0 or step == steps - 1:
            print(f"step {step:4d}  loss {loss:.4f}")

    # save, load, infer
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "spirals.lamina")
        lm.save(net, path)
        size = os.path.getsize(path)
        loaded = lm.load(path)
    pred = loaded.run({"x": x_test})["logits"].argmax(1)
    accuracy = (pred == y_test).mean()
    print(f"saved and loaded spirals.lamina ({size} bytes); loaded model's test accuracy: {accuracy:.3f}")
    same = np.array_equal(loaded.run({"x": x_test})["logits"], net.run({"x": x_test})["logits"])
    print(f"loaded and original give identical outputs: {same}")
    if accuracy < 0.9 or not same:
        raise SystemExit("quickstart: the trained model is worse than expected")


if __name__ == "__main__":
    main()
