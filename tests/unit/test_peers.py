"""A surviving rank's lost peer is one line, a defect keeps its traceback (resilience/peers.py)."""

from __future__ import annotations

from shardwise.resilience.peers import peer_lost


def _raised(outer: BaseException, inner: BaseException) -> BaseException:
    try:
        try:
            raise inner
        except BaseException as err:
            raise outer from err
    except BaseException as err:
        return err


def test_gloo_and_nccl_peer_loss_is_recognised_through_the_chain():
    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed "
                        "by peer [127.0.0.1]:41234. This is typically caused by a remote worker "
                        "crashing.\nmore")
    assert peer_lost(gloo) == "Connection closed by peer [127.0.0.1]:41234"
    wrapped = _raised(ValueError("step failed"), gloo)
    assert peer_lost(wrapped) is not None
    nccl = RuntimeError("NCCL error: remote process exited or there was a network error")
    assert peer_lost(nccl) is not None


def test_other_failures_are_not_a_lost_peer():
    assert peer_lost(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None
    assert peer_lost(ConnectionResetError("Connection reset by peer")) is None  # an OSError: S3
    assert peer_lost(ValueError("connection closed by peer")) is None
