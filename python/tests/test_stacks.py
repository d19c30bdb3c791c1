"""Where the rank's program is, as the sampler reads it (`podsim.torch._stack_of`): the main
thread's frames from faulthandler's dump, taken from another thread (no frame object is made:
one the sampler held would keep a returned function's tensors alive)."""

import threading
import traceback
import unittest

from podsim.torch import _stack_of, parse_thread_stack


class StackTest(unittest.TestCase):
    def test_the_main_threads_frames_as_traceback_gives_them(self):
        main = threading.get_ident()
        seen, ready, done = [], threading.Event(), threading.Event()

        def sampler():
            ready.wait()
            seen.append(_stack_of(main))
            done.set()

        t = threading.Thread(target=sampler)
        t.start()
        expected = traceback.extract_stack()
        ready.set()
        done.wait(10)  # two lines below `extract_stack`: where the sampler finds this thread
        t.join(10)
        want = [f"{f.filename}:{f.lineno} {f.name}" for f in expected]
        last = expected[-1]
        want[-1] = f"{last.filename}:{last.lineno + 2} {last.name}"
        # Below this function: `Event.wait`'s own frames in threading.py.
        self.assertEqual(seen[0][: len(want)], want)
        self.assertTrue(all("threading.py" in f for f in seen[0][len(want):]))

    def test_a_thread_absent_from_the_dump_is_none(self):
        text = ('Current thread 0x00007f0000000001 (most recent call first):\n'
                '  File "/a.py", line 3 in f\n'
                'Thread 0x00007f0000000002 (most recent call first):\n'
                '  File "/b.py", line 9 in g\n'
                '  File "/b.py", line 1 in <module>\n')
        self.assertEqual(parse_thread_stack(text, 0x7F0000000002),
                         ["/b.py:1 <module>", "/b.py:9 g"])
        self.assertIsNone(parse_thread_stack(text, 0x7F0000000003))


if __name__ == "__main__":
    unittest.main()
