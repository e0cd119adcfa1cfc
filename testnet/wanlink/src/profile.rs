//! A link profile, `RATE[,DELAY_MS[,LOSS_PCT]]`: `100mbit,25` is a 100 Mbit/s link with 25 ms of
//! one-way delay and no loss.

use std::fmt;
use std::str::FromStr;

/// What one peer's link to the rest of the testnet does.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Profile {
    /// The link's rate in kbit/s, each way.
    pub rate_kbit: u64,
    /// One-way delay in milliseconds between two peers on this profile. A path between
    /// profiles gets the mean of the two: each link contributes half of its own.
    pub delay_ms: f64,
    /// Percent of frames lost each way between two peers on this profile (the mean of the two
    /// links' losses on a mixed path).
    pub loss_pct: f64,
}

/// Why a profile does not parse: the message says what was wrong and what is expected.
#[derive(Debug, PartialEq, Eq)]
pub struct ProfileError(String);

impl fmt::Display for ProfileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}; a link profile is RATE[,DELAY_MS[,LOSS_PCT]], such as 100mbit,25 or 5mbit,100,1 \
             (RATE in kbit, mbit or gbit; a bare number is Mbit/s)",
            self.0
        )
    }
}

impl std::error::Error for ProfileError {}

impl FromStr for Profile {
    type Err = ProfileError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let fields: Vec<&str> = text.split(',').map(str::trim).collect();
        if fields.len() > 3 || fields[0].is_empty() {
            return Err(ProfileError(format!("`{text}` is not a link profile")));
        }
        let rate_kbit = parse_rate(fields[0])?;
        let number = |field: Option<&&str>, what: &str, max: f64| -> Result<f64, ProfileError> {
            let Some(field) = field else { return Ok(0.0) };
            match field.parse::<f64>() {
                Ok(v) if (0.0..=max).contains(&v) => Ok(v),
                _ => Err(ProfileError(format!(
                    "{what} `{field}` in `{text}` is not a number from 0 to {max}"
                ))),
            }
        };
        Ok(Profile {
            rate_kbit,
            delay_ms: number(fields.get(1), "DELAY_MS", 10_000.0)?,
            loss_pct: number(fields.get(2), "LOSS_PCT", 100.0)?,
        })
    }
}

fn parse_rate(field: &str) -> Result<u64, ProfileError> {
    let lower = field.to_ascii_lowercase();
    let (digits, kbit_per_unit) = if let Some(d) = lower.strip_suffix("gbit") {
        (d, 1_000_000.0)
    } else if let Some(d) = lower.strip_suffix("mbit") {
        (d, 1_000.0)
    } else if let Some(d) = lower.strip_suffix("kbit") {
        (d, 1.0)
    } else {
        (lower.as_str(), 1_000.0)
    };
    match digits.parse::<f64>() {
        Ok(v) if v > 0.0 && (v * kbit_per_unit) >= 8.0 && v.is_finite() => {
            Ok((v * kbit_per_unit).round() as u64)
        }
        _ => Err(ProfileError(format!(
            "RATE `{field}` is not a rate of at least 8kbit"
        ))),
    }
}

impl Profile {
    /// The one-way delay of a frame from a peer on `self` to a peer on `to`.
    pub fn path_delay_ms(&self, to: &Profile) -> f64 {
        (self.delay_ms + to.delay_ms) / 2.0
    }

    /// The probability that a frame from a peer on `self` to a peer on `to` is lost.
    pub fn path_loss(&self, to: &Profile) -> f64 {
        (self.loss_pct + to.loss_pct) / 200.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn profiles_parse_with_units_and_defaults() {
        let p: Profile = "100mbit,25".parse().unwrap();
        assert_eq!(
            p,
            Profile {
                rate_kbit: 100_000,
                delay_ms: 25.0,
                loss_pct: 0.0
            }
        );
        let p: Profile = "5,100,1.5".parse().unwrap();
        assert_eq!((p.rate_kbit, p.delay_ms, p.loss_pct), (5_000, 100.0, 1.5));
        let p: Profile = "1gbit".parse().unwrap();
        assert_eq!(p.rate_kbit, 1_000_000);
        let p: Profile = "512kbit, 10".parse().unwrap();
        assert_eq!((p.rate_kbit, p.delay_ms), (512, 10.0));
    }

    #[test]
    fn bad_profiles_name_the_field() {
        for (text, names) in [
            ("", "is not a link profile"),
            ("fast", "RATE `fast`"),
            ("0mbit", "RATE `0mbit`"),
            ("100mbit,-3", "DELAY_MS `-3`"),
            ("100mbit,25,150", "LOSS_PCT `150`"),
            ("1,2,3,4", "is not a link profile"),
        ] {
            let err = text.parse::<Profile>().unwrap_err().to_string();
            assert!(err.contains(names), "{text}: {err}");
            assert!(err.contains("RATE[,DELAY_MS[,LOSS_PCT]]"), "{err}");
        }
    }

    #[test]
    fn a_mixed_path_takes_the_mean_of_its_links() {
        let fast: Profile = "100mbit,20,0".parse().unwrap();
        let slow: Profile = "5mbit,100,2".parse().unwrap();
        assert_eq!(fast.path_delay_ms(&fast), 20.0);
        assert_eq!(fast.path_delay_ms(&slow), 60.0);
        assert!((slow.path_loss(&slow) - 0.02).abs() < 1e-12);
        assert!((fast.path_loss(&slow) - 0.01).abs() < 1e-12);
    }
}
