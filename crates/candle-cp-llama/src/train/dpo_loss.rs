//! The losses of a preference pair ([`DpoLoss`], TRL's `loss_type`), each with its derivatives
//! in the two answers' summed log-probabilities ([`pair_loss`]). With `a = log π(c) − log
//! π_ref(c)` and `b = log π(r) − log π_ref(r)` the answers' log-ratios and `h = a − b`:
//!
//! ```text
//! sigmoid    (1 − ε)·softplus(−βh) + ε·softplus(βh)
//! robust     ((1 − ε)·softplus(−βh) − ε·softplus(βh)) / (1 − 2ε)
//! exo_pair   σ(βh)·(log σ(βh) − log(1 − ε)) + σ(−βh)·(log σ(−βh) − log ε)
//! hinge      max(0, 1 − βh)
//! ipo        (h̄ − 1/(2β))²          h̄: a and b per scored token (TRL averages IPO's log-probabilities)
//! nca_pair   softplus(−βa) + ½·softplus(βa) + ½·softplus(βb)
//! sppo_hard  (a − 1/(2β))² + (b + 1/(2β))²
//! apo_zero   σ(−βa) + σ(βb)
//! apo_down   σ(βa) + σ(−βh)
//! discopop   (1 − σ(βh/τ))·softplus(−βh) + σ(βh/τ)·e^(−βh)          τ: DpoConfig::discopop_tau
//! simpo      (1 − ε)·softplus(γ − βh̄) + ε·softplus(βh̄ − γ)   h̄ of the mean log-probabilities, no reference
//! orpo       β·softplus(−log_odds) (+ the chosen answers' CE)        no reference
//! bco_pair   softplus(−(βa − δ)) + softplus(βb − δ)     δ: the running mean reward (super::bco)
//! aot_pair   the sigmoid loss of β·(a₍ₖ₎ − b₍ₖ₎)        a₍ₖ₎, b₍ₖ₎: the k-th smallest over the batch
//! aot        the sigmoid loss of β·(l₍ₖ₎ − l̃₍ₖ₎)        l = pc − pr, l̃ = rc − rr, each sorted
//! sft        the chosen answers' mean cross-entropy per scored token (no preference)
//! ```
//!
//! With an f-divergence other than the reverse KL ([`FDivergence`], TRL's `f_divergence_type`),
//! the sigmoid, robust, exo_pair, hinge and discopop losses take `h_js = h − softplus(a) +
//! softplus(b)` (Jensen–Shannon) or `h_α = (e^(−αb) − e^(−αa))/α` (α-divergence) for `h`.
//!
//! bco_pair, aot_pair, aot and sft need the whole batch ([`super::dpo::dpo_terms`],
//! [`super::bco`]); the others are per pair. Losses mix as TRL's `loss_type` lists with
//! `loss_weights` do ([`super::DpoConfig::mix`]; MPO: sigmoid 0.8, bco_pair 0.2, sft 1).

use super::dpo::DpoConfig;
use candle_core::{bail, Result};

/// The loss of a pair (TRL's `loss_type`; formulas in the [module docs](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DpoLoss {
    /// DPO's: `(1 − ε)·softplus(−β·h) + ε·softplus(β·h)` (ε: label smoothing).
    #[default]
    Sigmoid,
    /// Robust DPO (Chowdhury et al.): the sigmoid loss unbiased for labels flipped with
    /// probability ε.
    Robust,
    /// EXO's (Ji et al.) for pairs; needs `0 < ε < 0.5` (TRL advises 1e-3).
    ExoPair,
    /// IPO's (Azar et al.): `(h̄ − 1/(2β))²`, `h̄` the difference of the answers' log-ratios per
    /// scored token (as TRL computes it).
    Ipo,
    /// SLiC's hinge: `max(0, 1 − β·h)`.
    Hinge,
    /// NCA's (Chen et al.) for pairs: each answer's own reward, not only their difference.
    NcaPair,
    /// SPPO's (Wu et al.) hard-label form.
    SppoHard,
    /// APO-zero (D'Oosterlinck et al.): the chosen answer's likelihood up, the rejected one's
    /// down, each against the reference.
    ApoZero,
    /// APO-down: both answers' likelihoods down, the rejected one's more.
    ApoDown,
    /// DiscoPOP's (Chris Lu et al.; log-ratio modulated): the sigmoid loss blended into an
    /// exponential one as `βh` grows, with temperature τ ([`DpoConfig::discopop_tau`]).
    DiscoPop,
    /// SimPO's (Meng et al.), without a reference: `softplus(γ − β·h̄)` with label smoothing as
    /// the sigmoid loss's, `h̄` the difference of the answers' MEAN log-probabilities per
    /// scored token, γ [`DpoConfig::simpo_gamma`]. No reference pass.
    Simpo,
    /// ORPO's (Hong et al.), without a reference: `β·softplus(−log_odds)` plus the chosen
    /// answers' mean cross-entropy (weight 1, beside any [`DpoConfig::rpo_alpha`]), `log_odds`
    /// the log odds ratio of the answers' mean probabilities per token
    /// (`log(p/(1 − p))` of `p = exp(mean log-probability)`). No reference pass.
    Orpo,
    /// KTO's (Ethayarajh et al.; TRL's `KTOTrainer`): unpaired examples labelled desirable or
    /// not ([`super::PreferenceSet::from_unpaired`]), each against a KL baseline:
    /// [`super::kto`].
    Kto,
    /// BCO's for pairs (TRL's `bco_pair`): each answer's reward `β·(log π − log π_ref)` against
    /// δ, the running mean of the micro-batches' mean rewards ([`super::bco`]).
    BcoPair,
    /// BCO's (Jung et al. 2024, "Binary Classifier Optimization"; TRL's `BCOTrainer`):
    /// unpaired examples labelled desirable or not, without KL documents
    /// ([`super::PreferenceSet::without_kl_documents`]), each reward classified against δ:
    /// [`super::bco`].
    Bco,
    /// AOT's (Melnyk et al. 2024, "Distributional Preference Alignment of LLMs via Optimal
    /// Transport") for paired data: the batch's chosen log-ratios and rejected log-ratios each
    /// sorted, the sigmoid loss (with label smoothing) of `β·(a₍ₖ₎ − b₍ₖ₎)` per rank `k`.
    AotPair,
    /// AOT's for unpaired data: the batch's policy log-odds `pc − pr` and reference log-odds
    /// `rc − rr` each sorted, the sigmoid loss of `β·(l₍ₖ₎ − l̃₍ₖ₎)` per rank `k`.
    Aot,
    /// The chosen answers' mean cross-entropy per scored token (TRL's `sft` loss type: MPO's
    /// generation term in a [`super::DpoConfig::mix`]); no preference, rewards 0.
    Sft,
    /// APO-zero for unpaired examples (TRL's `KTOTrainer` `loss_type="apo_zero_unpaired"`):
    /// a desirable example costs `λ_D·(1 − σ(β·r))`, an undesirable one `λ_U·σ(β·r)`, no KL
    /// term (the data without KL documents, [`super::PreferenceSet::without_kl_documents`]):
    /// [`super::kto::apo_zero_unpaired_terms`].
    ApoZeroUnpaired,
}

/// The f-divergence of f-DPO (Wang et al. 2023, "Beyond Reverse KL"; TRL's `f_divergence_type`)
/// whose difference between the answers replaces `h` in the losses that take it
/// ([`DpoLoss::takes_f_divergence`]).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum FDivergence {
    /// DPO's own: `h = a − b`.
    #[default]
    ReverseKl,
    /// Jensen–Shannon: `h = (a − b) − (softplus(a) − softplus(b))`.
    JsDivergence,
    /// The α-divergence with coefficient α > 0 (TRL's `f_alpha_divergence_coef`, 1):
    /// `h = (e^(−αb) − e^(−αa))/α`, each exponent capped at f64's largest (as TRL's `cap_exp`).
    Alpha(f64),
}

impl FDivergence {
    /// TRL's name of it (`reverse_kl`, `js_divergence`, `alpha_divergence`).
    pub fn name(self) -> &'static str {
        match self {
            Self::ReverseKl => "reverse_kl",
            Self::JsDivergence => "js_divergence",
            Self::Alpha(_) => "alpha_divergence",
        }
    }

    /// The divergence named `name` (TRL's names; `alpha_divergence` with coefficient `alpha`).
    pub fn parse(name: &str, alpha: f64) -> Result<Self> {
        match name {
            "reverse_kl" => Ok(Self::ReverseKl),
            "js_divergence" => Ok(Self::JsDivergence),
            "alpha_divergence" => Ok(Self::Alpha(alpha)),
            _ => bail!("f-divergence {name:?}: expected reverse_kl, js_divergence or alpha_divergence"),
        }
    }

    /// `h` of the answers' log-ratios `a`, `b` and its derivatives `(h, ∂h/∂a, ∂h/∂b)`.
    pub fn h(self, a: f64, b: f64) -> (f64, f64, f64) {
        match self {
            Self::ReverseKl => (a - b, 1.0, -1.0),
            Self::JsDivergence => (a - b - softplus(a) + softplus(b), 1.0 - sigmoid(a), -(1.0 - sigmoid(b))),
            Self::Alpha(al) => {
                // (e^x capped: its derivative 0 above the cap)
                let cap = f64::MAX.ln();
                let e = |x: f64| if x > cap { (cap.exp(), 0.0) } else { (x.exp(), x.exp()) };
                let ((ea, da), (eb, db)) = (e(-al * a), e(-al * b));
                ((eb - ea) / al, da, -db)
            }
        }
    }
}

/// Every loss by its name (TRL's `loss_type` names).
pub const DPO_LOSSES: [(&str, DpoLoss); 19] = [
    ("sigmoid", DpoLoss::Sigmoid),
    ("robust", DpoLoss::Robust),
    ("exo_pair", DpoLoss::ExoPair),
    ("ipo", DpoLoss::Ipo),
    ("hinge", DpoLoss::Hinge),
    ("nca_pair", DpoLoss::NcaPair),
    ("sppo_hard", DpoLoss::SppoHard),
    ("apo_zero", DpoLoss::ApoZero),
    ("apo_down", DpoLoss::ApoDown),
    ("discopop", DpoLoss::DiscoPop),
    ("simpo", DpoLoss::Simpo),
    ("orpo", DpoLoss::Orpo),
    ("kto", DpoLoss::Kto),
    ("bco_pair", DpoLoss::BcoPair),
    ("bco", DpoLoss::Bco),
    ("aot_pair", DpoLoss::AotPair),
    ("aot", DpoLoss::Aot),
    ("sft", DpoLoss::Sft),
    ("apo_zero_unpaired", DpoLoss::ApoZeroUnpaired),
];

impl DpoLoss {
    /// Its name in [`DPO_LOSSES`], as parsed.
    pub fn name(self) -> &'static str {
        DPO_LOSSES.iter().find(|(_, l)| *l == self).map_or("?", |(n, _)| n)
    }

    /// Whether label smoothing ε applies to it (sigmoid, robust, exo_pair, simpo, aot_pair,
    /// aot).
    pub fn takes_label_smoothing(self) -> bool {
        matches!(self, Self::Sigmoid | Self::Robust | Self::ExoPair | Self::Simpo | Self::AotPair | Self::Aot)
    }

    /// Whether [`super::DpoConfig::f_divergence`] changes its `h` (sigmoid, robust, exo_pair,
    /// hinge, discopop: TRL's losses of its `logits`).
    pub fn takes_f_divergence(self) -> bool {
        matches!(self, Self::Sigmoid | Self::Robust | Self::ExoPair | Self::Hinge | Self::DiscoPop)
    }

    /// Whether a pair's loss depends on the other pairs of the batch (bco_pair, aot_pair, aot,
    /// sft): [`pair_loss`] gives `NaN` for these.
    pub fn batch_wide(self) -> bool {
        matches!(self, Self::BcoPair | Self::AotPair | Self::Aot | Self::Sft)
    }

    /// Whether it trains on unpaired examples (KTO, BCO, APO-zero unpaired) rather than
    /// preference pairs.
    pub fn unpaired(self) -> bool {
        matches!(self, Self::Kto | Self::Bco | Self::ApoZeroUnpaired)
    }

    /// Whether it weighs desirable and undesirable examples ([`super::DpoConfig::desirable_weight`],
    /// [`super::DpoConfig::undesirable_weight`]: KTO and APO-zero unpaired, as TRL's
    /// `KTOTrainer`).
    pub fn takes_example_weights(self) -> bool {
        matches!(self, Self::Kto | Self::ApoZeroUnpaired)
    }

    /// Whether it keeps a running mean reward across micro-batches (BCO's δ, [`super::bco`]).
    pub fn running_mean(self) -> bool {
        matches!(self, Self::Bco | Self::BcoPair)
    }
}

impl std::str::FromStr for DpoLoss {
    type Err = candle_core::Error;
    fn from_str(s: &str) -> Result<Self> {
        match DPO_LOSSES.iter().find(|(n, _)| *n == s) {
            Some((_, l)) => Ok(*l),
            None => bail!("DPO loss {s:?}: expected one of {}", DPO_LOSSES.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ")),
        }
    }
}

/// `softplus(x) = ln(1 + eˣ)`, without overflow.
pub(crate) fn softplus(x: f64) -> f64 {
    x.max(0.0) + (-x.abs()).exp().ln_1p()
}

/// `σ(x)`, without overflow.
pub(crate) fn sigmoid(x: f64) -> f64 {
    if x >= 0.0 {
        1.0 / (1.0 + (-x).exp())
    } else {
        let e = x.exp();
        e / (1.0 + e)
    }
}

/// AOT's loss over `pairs` (chosen, rejected answer indices into `policy` and `reference`):
/// [`DpoLoss::AotPair`] or [`DpoLoss::Aot`], the mean over sorted ranks `k` of the sigmoid loss
/// (label smoothing ε) of `β·δ₍ₖ₎`, and its derivatives by answer index (each rank's through the
/// pair that holds the k-th smallest value; ties in pair order, as a stable sort). `None` for
/// another loss.
pub(crate) fn aot_loss(cfg: &DpoConfig, loss: DpoLoss, policy: &[f64], reference: &[f64], pairs: &[(usize, usize)]) -> Option<(f64, Vec<f64>)> {
    let (eps, beta) = (cfg.label_smoothing, cfg.beta);
    let n = pairs.len().max(1) as f64;
    let sorted = |v: Vec<f64>| -> (Vec<f64>, Vec<usize>) {
        let mut idx: Vec<usize> = (0..v.len()).collect();
        idx.sort_by(|&i, &j| v[i].total_cmp(&v[j]).then(i.cmp(&j)));
        (idx.iter().map(|&i| v[i]).collect(), idx)
    };
    let (c, r) = (|p: &(usize, usize)| p.0, |p: &(usize, usize)| p.1);
    let ratio = |f: &dyn Fn(&(usize, usize)) -> usize| -> Vec<f64> { pairs.iter().map(|p| policy[f(p)] - reference[f(p)]).collect() };
    // (x sorted, its pairs' order; y sorted, its pairs' order; whether y's order is x's: aot)
    let ((x, ix), (y, iy)) = match loss {
        DpoLoss::AotPair => (sorted(ratio(&c)), sorted(ratio(&r))),
        DpoLoss::Aot => {
            let policy_odds = pairs.iter().map(|&(a, b)| policy[a] - policy[b]).collect();
            let reference_odds = pairs.iter().map(|&(a, b)| reference[a] - reference[b]).collect();
            (sorted(policy_odds), sorted(reference_odds))
        }
        _ => return None,
    };
    let (mut total, mut d) = (0.0, vec![0.0; policy.len()]);
    for k in 0..pairs.len() {
        let z = beta * (x[k] - y[k]);
        total += ((1.0 - eps) * softplus(-z) + eps * softplus(z)) / n;
        let dz = beta * (-(1.0 - eps) * sigmoid(-z) + eps * sigmoid(z)) / n;
        let (pc, pr) = pairs[ix[k]];
        match loss {
            // x: the chosen log-ratios, y: the rejected ones (through the pair at y's rank)
            DpoLoss::AotPair => {
                d[pc] += dz;
                d[pairs[iy[k]].1] -= dz;
            }
            // x: the policy's log-odds pc − pr; y: the reference's, a constant
            _ => {
                d[pc] += dz;
                d[pr] -= dz;
            }
        }
    }
    Some((total, d))
}

/// Tests: the derivatives `d` of `loss` at `x` against its central differences of step `h` in
/// the entries `which`, each within `tol`; `what` names the case in a failure.
#[cfg(test)]
pub(crate) fn assert_central_differences(loss: &dyn Fn(&[f64]) -> Result<f64>, x: &[f64], d: &[f64], which: &[usize], (h, tol): (f64, f64), what: &str) -> Result<()> {
    for &i in which {
        let (mut a, mut b) = (x.to_vec(), x.to_vec());
        a[i] += h;
        b[i] -= h;
        let fd = (loss(&a)? - loss(&b)?) / (2.0 * h);
        assert!((fd - d[i]).abs() < tol, "{what}, answer {i}: {fd} vs {}", d[i]);
    }
    Ok(())
}

/// One pair's loss (not those of the unpaired losses and of [`DpoLoss::batch_wide`] ones,
/// which need the batch: `NaN`) from the chosen and rejected answers'
/// summed log-probabilities under the policy (`pc`, `pr`) and the reference (`rc`, `rr`) and
/// their scored tokens (`lc`, `lr`): `(h, loss, ∂loss/∂pc, ∂loss/∂pr)`, `h` the difference the
/// reward accuracy and margin read (the log-ratios' — IPO's and SimPO's per token, ORPO's log
/// odds).
pub fn pair_loss(cfg: &DpoConfig, pc: f64, pr: f64, rc: f64, rr: f64, lc: f64, lr: f64) -> (f64, f64, f64, f64) {
    let (eps, beta) = (cfg.label_smoothing, cfg.beta);
    let (a, b) = (pc - rc, pr - rr);
    // (the f-divergence's h for the losses that take it; DPO's a − b for the others)
    let (h, ha, hb) = if cfg.loss.takes_f_divergence() { cfg.f_divergence.h(a, b) } else { (a - b, 1.0, -1.0) };
    // a loss of z = β·h: (its value, its derivative in z) → (h, loss, ∂/∂pc, ∂/∂pr)
    let of_h = |(l, dz): (f64, f64)| (h, l, beta * dz * ha, beta * dz * hb);
    let smoothed = |z: f64| ((1.0 - eps) * softplus(-z) + eps * softplus(z), -(1.0 - eps) * sigmoid(-z) + eps * sigmoid(z));
    // σ(x)·σ(−x): the derivative of σ
    let ds = |x: f64| sigmoid(x) * sigmoid(-x);
    let z = beta * h;
    match cfg.loss {
        DpoLoss::Sigmoid => of_h(smoothed(z)),
        DpoLoss::Robust => {
            let k = 1.0 - 2.0 * eps;
            of_h((((1.0 - eps) * softplus(-z) - eps * softplus(z)) / k, (-(1.0 - eps) * sigmoid(-z) - eps * sigmoid(z)) / k))
        }
        DpoLoss::ExoPair => {
            let (lw, ll) = ((-eps).ln_1p(), eps.ln());
            let (qw, ql) = (sigmoid(z), sigmoid(-z));
            of_h((qw * (-softplus(-z) - lw) + ql * (-softplus(z) - ll), qw * ql * (z - lw + ll)))
        }
        DpoLoss::Hinge => of_h(((1.0 - z).max(0.0), if z < 1.0 { -1.0 } else { 0.0 })),
        DpoLoss::Ipo => {
            let hm = a / lc - b / lr;
            let d = 2.0 * (hm - 0.5 / beta);
            (hm, (hm - 0.5 / beta).powi(2), d / lc, -d / lr)
        }
        DpoLoss::NcaPair => {
            let (x, y) = (beta * a, beta * b);
            (h, softplus(-x) + 0.5 * softplus(x) + 0.5 * softplus(y), beta * (-sigmoid(-x) + 0.5 * sigmoid(x)), 0.5 * beta * sigmoid(y))
        }
        DpoLoss::SppoHard => {
            let (u, v) = (a - 0.5 / beta, b + 0.5 / beta);
            (h, u * u + v * v, 2.0 * u, 2.0 * v)
        }
        DpoLoss::ApoZero => (h, sigmoid(-beta * a) + sigmoid(beta * b), -beta * ds(beta * a), beta * ds(beta * b)),
        DpoLoss::ApoDown => (h, sigmoid(beta * a) + sigmoid(-z), beta * ds(beta * a) - beta * ds(z), beta * ds(z)),
        DpoLoss::DiscoPop => {
            // m = σ(z/τ); e^(−z)·m and e^(−z)·m' in log space (e^(−z) overflows where m is 0)
            let tau = cfg.discopop_tau;
            let m = sigmoid(z / tau);
            let em = (-z - softplus(-z / tau)).exp();
            let em_d = (-z - softplus(-z / tau) - softplus(z / tau)).exp() / tau;
            let l = softplus(-z) * (1.0 - m) + em;
            let dz = -sigmoid(-z) * (1.0 - m) - em + em_d - softplus(-z) * ds(z / tau) / tau;
            of_h((l, dz))
        }
        DpoLoss::Simpo => {
            let hm = pc / lc - pr / lr;
            let (l, dz) = smoothed(beta * hm - cfg.simpo_gamma);
            (hm, l, beta * dz / lc, -beta * dz / lr)
        }
        DpoLoss::Orpo => {
            // log(p/(1 − p)) of p = exp(ā) and its derivative 1/(1 − p) in ā (ā < 0: a mean
            // log-probability; 1 − p as −expm1(ā), exact near 0)
            let odds = |x: f64| -> (f64, f64) {
                let q = -(x.min(-1e-12)).exp_m1();
                (x - q.ln(), 1.0 / q)
            };
            let ((oc, gc), (or, gr)) = (odds(pc / lc), odds(pr / lr));
            let ho = oc - or;
            let dh = -beta * sigmoid(-ho);
            (ho, beta * softplus(-ho), dh * gc / lc, -dh * gr / lr)
        }
        DpoLoss::Kto | DpoLoss::Bco | DpoLoss::ApoZeroUnpaired | DpoLoss::BcoPair | DpoLoss::AotPair | DpoLoss::Aot | DpoLoss::Sft => (f64::NAN, f64::NAN, f64::NAN, f64::NAN),
    }
}

#[cfg(test)]
#[path = "dpo_loss_tests.rs"]
mod tests;
