"""The frames between a rank and its chip (`podsim._wire`), against a chip played by this test
on an abstract Unix socket: no podsim binary."""

import json
import os
import socket
import struct
import threading
import unittest

import torch

from podsim._wire import Connection, PodsimError

HEADER = struct.Struct("<IIQ")
MAGIC = int.from_bytes(b"PDT1", "little")


def frame(reply, payload=b"", magic=MAGIC):
    body = json.dumps(reply).encode()
    return HEADER.pack(magic, len(body), len(payload)) + body + payload


class FakeChip:
    """Accepts one rank, answers its hello, then plays `script(conn)`."""

    def __init__(self, script):
        self.name = f"podsim-test-{os.getpid()}-{id(self)}"
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind("\0" + self.name)
        self.server.listen(1)
        self.server.settimeout(10)
        self.requests = []
        self.thread = threading.Thread(target=self._serve, args=(script,), daemon=True)
        self.thread.start()

    def read_frame(self, conn):
        magic, json_len, payload_len = HEADER.unpack(self._exact(conn, HEADER.size))
        assert magic == MAGIC
        request = json.loads(self._exact(conn, json_len))
        payload = self._exact(conn, payload_len)
        self.requests.append((request, payload))
        return request, payload

    @staticmethod
    def _exact(conn, n):
        data = b""
        while len(data) < n:
            chunk = conn.recv(n - len(data))
            if not chunk:
                raise EOFError
            data += chunk
        return data

    def _serve(self, script):
        conn, _ = self.server.accept()
        conn.settimeout(10)
        with conn:
            self.read_frame(conn)
            conn.sendall(frame({"ok": True}))
            script(self, conn)

    def close(self):
        self.thread.join(10)
        self.server.close()


class Framing(unittest.TestCase):
    def connect(self, script):
        chip = FakeChip(script)
        self.addCleanup(chip.close)
        connection = Connection(chip.name, 3, "secret")
        self.addCleanup(connection.close)
        return chip, connection

    def test_hello_names_the_rank_and_its_token(self):
        chip, connection = self.connect(lambda chip, conn: None)
        connection.close()
        chip.close()
        hello, payload = chip.requests[0]
        self.assertEqual((hello["op"], hello["rank"], hello["token"]), ("hello", 3, "secret"))
        self.assertEqual(hello["pid"], os.getpid())
        self.assertEqual(payload, b"")

    def test_a_payload_goes_out_and_comes_back_as_float32_values(self):
        def echo(chip, conn):
            request, payload = chip.read_frame(conn)
            conn.sendall(frame({"echo": request["op"]}, payload))

        chip, connection = self.connect(echo)
        values = torch.arange(1000, dtype=torch.float32) / 7
        reply, back = connection.call({"op": "echo"}, values)
        self.assertEqual(reply, {"echo": "echo"})
        self.assertTrue(torch.equal(back, values))

    def answering(self, reply, hang_up=False):
        """A connection to a chip that reads one request and sends back the bytes `reply`
        (then hangs up when told to)."""

        def answer(chip, conn):
            chip.read_frame(conn)
            conn.sendall(reply)
            if hang_up:
                conn.shutdown(socket.SHUT_RDWR)

        return self.connect(answer)[1]

    def test_a_reply_is_read_into_the_callers_buffer(self):
        connection = self.answering(frame({}, torch.ones(4).numpy().tobytes()))
        out = torch.zeros(4)
        _, back = connection.call({"op": "x"}, out=out)
        self.assertIs(back, out)
        self.assertTrue(torch.equal(out, torch.ones(4)))

    def test_the_callers_tensors_stay_resizable(self):
        # FSDP frees and refills the storages it hands a collective; a view of a tensor
        # through numpy would have made them unresizable for good.
        def echo(chip, conn):
            request, payload = chip.read_frame(conn)
            conn.sendall(frame({}, payload))

        chip, connection = self.connect(echo)
        values, out = torch.arange(16, dtype=torch.float32), torch.zeros(16)
        connection.call({"op": "echo"}, values, out=out)
        self.assertTrue(torch.equal(out, values))
        for t in (values, out):
            self.assertTrue(t.untyped_storage().resizable())
            t.untyped_storage().resize_(0)

    def test_an_error_reply_is_raised_with_the_chips_words(self):
        connection = self.answering(frame({"error": "group 9 does not exist"}))
        with self.assertRaisesRegex(PodsimError, "group 9 does not exist"):
            connection.call({"op": "all_reduce"})

    def test_a_reply_out_of_step_is_refused(self):
        connection = self.answering(frame({}, magic=0xDEADBEEF))
        with self.assertRaisesRegex(PodsimError, "out of step"):
            connection.call({"op": "x"})

    def test_a_chip_that_hangs_up_mid_payload_is_an_error_not_a_hang(self):
        body = b"{}"  # announces 64 payload bytes, sends 10
        connection = self.answering(HEADER.pack(MAGIC, len(body), 64) + body + bytes(10),
                                    hang_up=True)
        with self.assertRaisesRegex(PodsimError, "closed the connection"):
            connection.call({"op": "x"})

if __name__ == "__main__":
    unittest.main()


class RankRunsTest(unittest.TestCase):
    """A group's ranks travel as runs `[first, count, stride]` that expand to the same list."""

    def expand(self, runs):
        return [first + i * stride for first, count, stride in runs for i in range(count)]

    def test_runs_expand_to_the_ranks_and_stay_few_for_structured_groups(self):
        from podsim.torch import rank_runs

        cases = [
            [],
            [7],
            list(range(262_144)),
            list(range(3, 4096, 8)),
            [0, 1, 2, 10, 20, 30, 31],
            [5, 5, 6],
        ]
        for ranks in cases:
            runs = rank_runs(ranks)
            self.assertEqual(self.expand(runs), ranks)
        # The world group and a mesh column are one run each, whatever their size.
        self.assertEqual(rank_runs(list(range(262_144))), [[0, 262_144, 1]])
        self.assertEqual(rank_runs(list(range(3, 4096, 8))), [[3, 512, 8]])
