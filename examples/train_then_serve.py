"""Train a small CNN built from jaxfuse's Flax layers with optax, then serve it fused.

Training (``train=True``) runs flax's own conv and batch-norm layers, so it trains exactly like
the plain flax model. Serving (``train=False``) runs every conv + batch norm + activation as one
fused kernel on the same variables. At the end the served outputs are checked against the same
network built from plain ``nn.Conv`` + ``nn.BatchNorm`` layers, which loads the trained
variables as they are.

Runs on the CPU in seconds: ``python examples/train_then_serve.py``.
"""

import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxfuse.flax import linen as fl
from jaxfuse.rewrite import count_fused_calls

CLASSES, BATCH, SIZE, STEPS = 4, 32, 16, 30
MOMENTUM = 0.9  # flax's default 0.99 needs hundreds of steps before the running stats settle

# (name, features, strides, groups, activation) of each conv + batch norm + activation block.
BLOCKS = (("stem", 16, 1, 1, jax.nn.relu),
          ("down", 32, 2, 1, jax.nn.relu6),
          ("depthwise", 32, 1, 32, jax.nn.relu),
          ("pointwise", 32, 1, 1, jax.nn.relu))


class FusedCNN(nn.Module):
    """The model, from jaxfuse's fused layers."""

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        for name, features, strides, groups, act in BLOCKS:
            kernel = (1, 1) if name == "pointwise" else (3, 3)
            x = fl.ConvBNAct(features, kernel, strides=strides, feature_group_count=groups,
                             use_bias=False, momentum=MOMENTUM, activation=act,
                             use_running_average=not train, name=name)(x)
        return nn.Dense(CLASSES, name="head")(x.mean(axis=(1, 2)))


class PlainBlock(nn.Module):
    """nn.Conv named "conv", nn.BatchNorm named "bn": ConvBNAct's variable layout."""

    features: int
    kernel: tuple[int, int]
    strides: int
    groups: int
    act: object

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        x = nn.Conv(self.features, self.kernel, strides=self.strides, use_bias=False,
                    feature_group_count=self.groups, name="conv")(x)
        bn = nn.BatchNorm(use_running_average=not train, momentum=MOMENTUM, name="bn")
        return self.act(bn(x))


class PlainCNN(nn.Module):
    """The same network from plain flax layers (the reference)."""

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        for name, features, strides, groups, act in BLOCKS:
            kernel = (1, 1) if name == "pointwise" else (3, 3)
            x = PlainBlock(features, kernel, strides, groups, act, name=name)(x, train)
        return nn.Dense(CLASSES, name="head")(x.mean(axis=(1, 2)))


def synthetic_batch(rng: np.random.Generator, templates: np.ndarray) -> tuple[jax.Array, ...]:
    """Images = a class's template + noise, so a few steps of training lower the loss."""
    labels = rng.integers(0, CLASSES, BATCH)
    images = templates[labels] + 0.5 * rng.standard_normal((BATCH, SIZE, SIZE, 3))
    return jnp.asarray(images, jnp.float32), jnp.asarray(labels)


def main() -> None:
    rng = np.random.default_rng(0)
    templates = rng.standard_normal((CLASSES, SIZE, SIZE, 3))
    model = FusedCNN()
    x, _ = synthetic_batch(rng, templates)
    variables = model.init(jax.random.key(0), x, train=False)
    params, batch_stats = variables["params"], variables["batch_stats"]
    tx = optax.adam(3e-3)
    opt_state = tx.init(params)

    @jax.jit
    def train_step(params, batch_stats, opt_state, images, labels):
        def loss_fn(params):
            logits, updates = model.apply({"params": params, "batch_stats": batch_stats},
                                          images, train=True, mutable=["batch_stats"])
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
            return loss, updates["batch_stats"]

        (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), batch_stats, opt_state, loss

    # 1. Train: flax's layers, batch statistics, optax; nothing jaxfuse-specific.
    start = time.perf_counter()
    for step in range(STEPS):
        images, labels = synthetic_batch(rng, templates)
        params, batch_stats, opt_state, loss = train_step(params, batch_stats, opt_state,
                                                          images, labels)
        if step % 10 == 0 or step == STEPS - 1:
            print(f"step {step:2d}  loss {float(loss):.3f}")
    print(f"trained {STEPS} steps in {time.perf_counter() - start:.1f} s")
    trained = {"params": params, "batch_stats": batch_stats}

    # 2. Serve: each block is one fused kernel (conv + batch norm + activation) where that
    # measured faster than XLA's own ops for it on this device, else XLA's ops.
    serve = jax.jit(lambda v, x: model.apply(v, x, train=False))
    images, labels = synthetic_batch(rng, templates)
    logits = serve(trained, images)
    jaxpr = jax.make_jaxpr(lambda v, x: model.apply(v, x, train=False))(trained, images)
    fused_ops = count_fused_calls(jaxpr)
    accuracy = float((logits.argmax(-1) == labels).mean())
    print(f"served a batch with {fused_ops} of {len(BLOCKS)} blocks on fused kernels (the rest "
          f"measured faster as XLA's ops); accuracy {accuracy:.2f}")

    # 3. The plain flax model loads the same variables unchanged and agrees.
    reference = jax.jit(lambda v, x: PlainCNN().apply(v, x, train=False))(trained, images)
    err = float(jnp.linalg.norm(logits - reference) / jnp.linalg.norm(reference))
    print(f"fused vs plain flax inference: relative error {err:.1e}")
    assert err < 1e-4, err


if __name__ == "__main__":
    main()
