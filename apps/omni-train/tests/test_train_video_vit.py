"""The ViT on videos without ``transformers`` (its oracle tests: ``test_train_hf_video.py``): the patch
layout against a brute-force pixel lookup, still images at ``temporal_patch = 2`` equal to a two-frame
clip of the image, and long-short sequence parallelism over a video equal to the unsplit tower."""

import torch
import torch.distributed as dist

from omni_parallel.testing import run_world
from omni_train.models import ImageTower, ViTConfig, patchify
from omni_train.models.attention import mrope_angles, rope_angles
from omni_train.models.vit import patchify_video

P, M, T = 14, 2, 2


def test_video_patches_are_the_pixels_of_their_slice_window_and_frame():
    frames = torch.randn(5, 3, 56, 84, generator=torch.Generator().manual_seed(0))
    x, (t, gh, gw) = patchify_video(frames, P, M, T)
    assert (t, gh, gw) == (3, 4, 6) and x.shape == (3 * 4 * 6, 3 * T * P * P)
    padded = torch.cat([frames, frames[-1:]])  # 5 frames: the last repeats
    n = 0
    for s in range(t):
        for wr in range(gh // M):
            for wc in range(gw // M):
                for r in range(M):
                    for c in range(M):
                        y, z = (wr * M + r) * P, (wc * M + c) * P
                        want = padded[s * T : (s + 1) * T, :, y : y + P, z : z + P]  # [frame, channel, ...]
                        assert torch.equal(x[n], want.transpose(0, 1).reshape(-1))  # (channel, frame, y, x)
                        n += 1


def test_an_image_is_a_two_frame_clip_of_itself():
    cfg = ViTConfig(dim=32, n_heads=4, temporal_patch=2)
    tower = ImageTower(cfg, 24, seed=1)
    image = torch.randn(3, 56, 28, generator=torch.Generator().manual_seed(1))
    still, (gh, gw) = patchify(image, P, M, T)
    clip, thw = patchify_video(image[None].expand(2, -1, -1, -1), P, M, T)
    assert torch.equal(still, clip) and thw == (1, gh, gw)
    with torch.no_grad():
        assert torch.equal(tower(still, torch.tensor([[gh, gw]])), tower(clip, torch.tensor([thw])))


def test_mrope_with_equal_axes_is_rope():
    pos = torch.tensor([0, 1, 2, 0, 1, 5, 9])
    for a, b in zip(mrope_angles(pos[None].expand(3, -1), 16, 1e4, [2, 3, 3]), rope_angles(pos, 16, 1e4)):
        assert torch.equal(a, b)


def _sp_rank(rank: int, world: int, cfg: ViTConfig, state: dict, patches, grids) -> torch.Tensor:
    tower = ImageTower(cfg, 48).double()
    tower.load_state_dict(state)
    with torch.no_grad():
        return tower(patches, grids, dist.group.WORLD)


def test_video_long_short_sp_split_equals_unsplit():
    """A video and an image over 2 encoder-SP ranks (19 merged tokens: chunks of 10, one padding row;
    the cut falls inside the video's second temporal slice) give the unsplit tower's tokens (float64)."""
    cfg = ViTConfig(dim=32, n_heads=4, temporal_patch=2, act="quick_gelu")
    tower = ImageTower(cfg, 48, seed=3).double()
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for p in tower.parameters():
            if p.dim() == 1:  # biases and norms away from their init of zeros and ones
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.1)
    video, vgrid = patchify_video(torch.randn(6, 3, 56, 84, generator=g, dtype=torch.float64), P, M, T)
    image, igrid = patchify(torch.randn(3, 28, 28, generator=g, dtype=torch.float64), P, M, T)
    patches = torch.cat([video, image])
    grids = torch.tensor([list(vgrid), [1, *igrid]])
    with torch.no_grad():
        whole = tower(patches, grids)
    assert whole.shape[0] == 19 and whole.std() > 0.1
    parts = run_world(_sp_rank, 2, args=(cfg, tower.state_dict(), patches, grids), timeout_s=120)
    split = torch.cat(parts)
    assert split.shape[0] == 20
    torch.testing.assert_close(split[:19], whole, rtol=0, atol=1e-12)
