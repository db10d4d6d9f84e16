"""Running a coroutine on a new event loop from synchronous code."""

import threading

from skyrl.train.utils.background_loop import run_in_new_loop


class Batch:
    """A result that counts how often it is formatted."""

    reprs = 0

    def __repr__(self) -> str:
        Batch.reprs += 1
        return "Batch()"


def test_a_new_loop_returns_the_result_without_formatting_it():
    """In the main thread under Python's default SIGINT handler, `asyncio.run` formats its main task, result
    included, as it exits (Python 3.11): for a batch of episodes that is every token id."""

    async def produce() -> Batch:
        return Batch()

    assert threading.current_thread() is threading.main_thread()
    result = run_in_new_loop(produce())
    assert isinstance(result, Batch)
    assert Batch.reprs == 0
