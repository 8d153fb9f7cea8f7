// The fleet heatmap's model: the map's compact answer laid out as pixels, one per GPU. Racks are
// columns of nodes, nodes rows of GPUs (an NVL72 rack draws as its 18 trays of 4). Two images
// are built once: `exact` (each GPU where it sits) and `sorted` (each rack's GPUs sorted by
// state), drawn by the page with the zoom transform; zoomed out, the sorted one is drawn with
// smoothing, so a rack reads as the shares of its states (aggregated), not as noise.

export interface FleetMapData {
  generatedAt: string;
  regions: string[];
  racks: { name: string; region: number; kind: string; block: string; nodes: number }[];
  models: string[];
  nodes: string[];
  nodeStates: string;
  nodeModels: number[];
  gpuCounts: number[];
  gpus: string;
  mig: { gpu: number; layout: string }[];
  legend: { code: string; name: string; description: string }[];
}

// Okabe–Ito and Tol colours: apart under every common colour-vision deficiency; the legend,
// the tooltip and (zoomed in) a letter in each cell say the state in words too.
export const COLOURS: Record<string, string> = {
  ".": "#e3e6ea",
  P: "#b9d7ee",
  D: "#0072B2",
  V: "#56B4E9",
  C: "#332288",
  M: "#009E73",
  m: "#44AA99",
  F: "#CC79A7",
  T: "#AA4499",
  K: "#8c8c8c",
  S: "#F0E442",
  Q: "#E69F00",
  A: "#999933",
  X: "#000000",
};

export const RACK_GAP = 2; // pixels between racks
export const REGION_GAP = 12; // between regions (room for the region's name)

export interface Cell {
  gpu: number; // index into gpus
  node: number;
  rack: number;
  index: number; // the GPU's index on its node
}

export interface Layout {
  width: number;
  height: number;
  exact: HTMLCanvasElement;
  sorted: HTMLCanvasElement;
  at: Int32Array; // pixel -> GPU index (-1: gap)
  rackAt: Int32Array; // pixel -> rack index over the rack's whole box, gaps inside it too (-1: none)
  rackCounts: Record<string, number>[]; // per rack: GPUs by state
  cells: Cell[]; // per GPU
  rackBoxes: { x: number; y: number; w: number; h: number; rack: number }[];
  regionY: { y: number; region: number }[];
  counts: Record<string, number>;
  mig: Map<number, string>; // GPU index -> its MIG layout (GPUs in MIG mode)
}

function rgb(hex: string): [number, number, number] {
  const n = parseInt(hex.slice(1), 16);
  return [(n >> 16) & 255, (n >> 8) & 255, n & 255];
}

/** Lay the map out near `aspect` (width / height). */
export function layout(m: FleetMapData, aspect: number): Layout {
  // Node and GPU offsets of each rack.
  const rackNode: number[] = [];
  const nodeGpu: number[] = [];
  let n = 0;
  for (const r of m.racks) {
    rackNode.push(n);
    n += r.nodes;
  }
  let g = 0;
  for (const c of m.gpuCounts) {
    nodeGpu.push(g);
    g += c;
  }
  // Each region its own grid of equal boxes, sized by its widest node and tallest rack, and as
  // many boxes a row as keep the whole map near the viewport's aspect ratio.
  const sizes = m.regions.map((_, region) => {
    let w = 1;
    let h = 1;
    m.racks.forEach((r, i) => {
      if (r.region !== region) return;
      h = Math.max(h, r.nodes);
      for (let k = 0; k < r.nodes; k++) w = Math.max(w, m.gpuCounts[rackNode[i] + k]);
    });
    return { w: w + RACK_GAP, h: h + RACK_GAP, racks: m.racks.filter((r) => r.region === region).length };
  });
  const area = sizes.reduce((a, z) => a + z.w * z.h * z.racks, 0);
  const width = Math.max(1, Math.round(Math.sqrt(area * aspect)));
  const boxes: Layout["rackBoxes"] = [];
  const regionY: Layout["regionY"] = [];
  let y = 0;
  let x = 0;
  let region = -1;
  for (let i = 0; i < m.racks.length; i++) {
    const r = m.racks[i];
    const z = sizes[r.region];
    if (r.region !== region) {
      if (region !== -1) y += sizes[region].h;
      y += REGION_GAP;
      regionY.push({ y, region: r.region });
      region = r.region;
      x = 0;
    } else if (x + z.w > width) {
      x = 0;
      y += z.h;
    }
    boxes.push({ x, y, w: z.w - RACK_GAP, h: r.nodes, rack: i });
    x += z.w;
  }
  const height = Math.max(1, y + (region === -1 ? 0 : sizes[region].h));
  const exact = document.createElement("canvas");
  const sorted = document.createElement("canvas");
  exact.width = sorted.width = width;
  exact.height = sorted.height = height;
  const ex = exact.getContext("2d")!;
  const so = sorted.getContext("2d")!;
  const a = ex.createImageData(width, height);
  const b = so.createImageData(width, height);
  const at = new Int32Array(width * height).fill(-1);
  const rackAt = new Int32Array(width * height).fill(-1);
  const rackCounts: Record<string, number>[] = m.racks.map(() => ({}));
  const cells: Cell[] = new Array(m.gpus.length);
  const counts: Record<string, number> = {};
  const order = m.legend.map((l) => l.code);
  const rank: Record<string, number> = Object.fromEntries(order.map((c, i) => [c, i]));
  const palette: Record<string, [number, number, number]> = Object.fromEntries(Object.entries(COLOURS).map(([k, v]) => [k, rgb(v)]));
  const put = (img: ImageData, px: number, code: string) => {
    const [r, gg, bb] = palette[code] ?? [255, 0, 255];
    const o = px * 4;
    img.data[o] = r;
    img.data[o + 1] = gg;
    img.data[o + 2] = bb;
    img.data[o + 3] = 255;
  };
  for (const box of boxes) {
    const r = m.racks[box.rack];
    const codes: string[] = [];
    for (let k = 0; k < r.nodes; k++) {
      const node = rackNode[box.rack] + k;
      const first = nodeGpu[node];
      for (let i = 0; i < m.gpuCounts[node]; i++) {
        const gpu = first + i;
        const code = m.gpus[gpu];
        const px = (box.y + k) * width + box.x + i;
        put(a, px, code);
        at[px] = gpu;
        cells[gpu] = { gpu, node, rack: box.rack, index: i };
        counts[code] = (counts[code] ?? 0) + 1;
        rackCounts[box.rack][code] = (rackCounts[box.rack][code] ?? 0) + 1;
        codes.push(code);
      }
    }
    for (let k = 0; k < r.nodes; k++) rackAt.fill(box.rack, (box.y + k) * width + box.x, (box.y + k) * width + box.x + box.w);
    codes.sort((p, q) => rank[p] - rank[q]);
    // The sorted image fills the rack's box row by row with its GPUs in state order.
    let j = 0;
    for (let k = 0; k < r.nodes && j < codes.length; k++) {
      for (let i = 0; i < box.w && j < codes.length; i++) put(b, (box.y + k) * width + box.x + i, codes[j++]);
    }
  }
  ex.putImageData(a, 0, 0);
  so.putImageData(b, 0, 0);
  const mig = new Map(m.mig.map((x) => [x.gpu, x.layout]));
  return { width, height, exact, sorted, at, rackAt, rackCounts, cells, rackBoxes: boxes, regionY, counts, mig };
}
