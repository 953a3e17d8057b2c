"""The parts of vmmbuf_torch that need no GPU and no PyTorch."""
import ctypes
import os
import unittest

import vmmbuf_torch


class NoGpu(unittest.TestCase):
    def test_finds_the_library_and_its_symbols(self):
        path = vmmbuf_torch.find_library()
        self.assertIsNotNone(path, "build it first: cargo build -p vmmbuf-torch")
        lib = ctypes.CDLL(path)
        for sym in ("vmmbuf_malloc", "vmmbuf_free", "vmmbuf_stats_json", "vmmbuf_set_budget",
                    "vmmbuf_set_tag", "vmmbuf_sleep", "vmmbuf_wake"):
            self.assertTrue(hasattr(lib, sym), sym)

    def test_a_missing_library_is_reported(self):
        old = os.environ.get("VMMBUF_TORCH_LIB")
        os.environ["VMMBUF_TORCH_LIB"] = "/nonexistent/libvmmbuf_torch.so"
        try:
            self.assertIsNone(vmmbuf_torch.find_library())
        finally:
            if old is None:
                del os.environ["VMMBUF_TORCH_LIB"]
            else:
                os.environ["VMMBUF_TORCH_LIB"] = old

    def test_stats_without_an_arena_are_empty_and_json_parses(self):
        self.assertEqual(vmmbuf_torch.stats(5), {})
        s = vmmbuf_torch.parse_stats('{"allocated_bytes.all.peak": 512, "num_ooms": 0}')
        self.assertEqual(s["allocated_bytes.all.peak"], 512)

    def test_a_budget_can_be_set_before_use(self):
        self.assertEqual(vmmbuf_torch._lib().vmmbuf_set_budget(6, 1 << 30), 0)

    def test_tags_nest_and_sleep_without_memory_moves_nothing(self):
        with vmmbuf_torch.tag("weights"):
            self.assertEqual(vmmbuf_torch._TAG, "weights")
            with vmmbuf_torch.tag("kv"):
                self.assertEqual(vmmbuf_torch._TAG, "kv")
            self.assertEqual(vmmbuf_torch._TAG, "weights")
        self.assertEqual(vmmbuf_torch._TAG, "")
        # No arena exists in this process: nothing to move, and no error.
        self.assertEqual(vmmbuf_torch.sleep(), 0)
        self.assertEqual(vmmbuf_torch.wake(["weights", None]), 0)


if __name__ == "__main__":
    unittest.main()
