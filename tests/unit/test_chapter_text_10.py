"""Chapter 10's numbers are what distlab.domain computes; the test fails when the text drifts from the code."""

from pathlib import Path

from distlab import domain

CHAPTER = (Path(__file__).resolve().parents[2] / "chapters" / "10_domain_parallel.md").read_text()


def surface_table() -> str:
    lines = ["| ranks | split | ranks as rows x cols | tile (cells) | halo cells per tile cell |",
             "|---:|:---|:---|:---|---:|"]
    for row in domain.surface_to_volume_rows(720, 1440, (4, 16, 80), radius=3):
        lines.append(f"| {row['ranks']} | {row['split']} | {row['grid'][0]} x {row['grid'][1]} | "
                     f"{row['tile'][0]} x {row['tile'][1]} | {100 * row['ratio']:.2f}% |")
    return "\n".join(lines)


def test_surface_to_volume_table():
    assert surface_table() in CHAPTER, "the table in chapter 10 is stale:\n" + surface_table()


def test_halo_bytes_of_the_default_runs():
    assert domain.receptive_radius([3, 3, 3]) == 3 and "three 3 x 3 layers see 3 cells away" in CHAPTER
    bands = domain.TileGrid(4, 1, 32, 32)
    sent = [domain.halo_send_bytes(bands, r, 3, channels=4, batch=2) for r in range(4)]
    assert sent == [3072, 6144, 6144, 3072]
    assert f"**{sent[1]:,} bytes**" in CHAPTER and f"**{sent[0]:,}**" in CHAPTER
    tiles = domain.TileGrid(2, 2, 32, 32)
    sent = {domain.halo_send_bytes(tiles, r, 3, channels=4, batch=2) for r in range(4)}
    assert sent == {3648} and "**3,648 bytes**" in CHAPTER
