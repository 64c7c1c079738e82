import os
import signal

from armor_megatron.trainer.preemption import PreemptionHandler


def test_signals_are_recorded_not_fatal_and_handlers_restored():
    before = signal.getsignal(signal.SIGUSR1)
    with PreemptionHandler() as handler:
        assert not handler.requested()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert handler.requested() and handler.received == signal.SIGUSR1
        os.kill(os.getpid(), signal.SIGTERM)
        assert handler.received == signal.SIGTERM
    assert signal.getsignal(signal.SIGUSR1) is before
