//! The checks of everything received, each failing with a typed [`Rejection`]: a whole buffer
//! of this model, finite values, and (for parameters and deltas) a distance within the limit
//! the policy's running median sets.

use murmur_trainer::averaging;

use crate::node::messages::Rejection;

/// Distances below this share of a replica's norm are never outliers: once replicas agree, the
/// median gets tiny and ordinary drift would otherwise look like an outlier.
const OUTLIER_FLOOR: f64 = 0.05;

/// Checks that `values` is a whole buffer of `count` finite values; the rejection names `what`.
pub(super) fn full_and_finite(
    values: &[f32],
    count: usize,
    what: &'static str,
) -> Result<(), Rejection> {
    if values.len() != count {
        return Err(Rejection::WrongLength {
            what,
            found: values.len(),
            expected: count,
        });
    }
    if !values.iter().all(|v| v.is_finite()) {
        return Err(Rejection::NotFinite { what });
    }
    Ok(())
}

/// Whether `distance` from the replica `own` is past `limit` (the policy's; `None` while it has
/// no baseline) and past the floor.
pub(super) fn is_outlier(distance: f64, limit: Option<f64>, own: &[f32]) -> bool {
    !distance.is_finite()
        || limit.is_some_and(|limit| {
            distance > limit && distance > OUTLIER_FLOOR * averaging::norm(own)
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_of_another_length_or_with_nan_are_rejected_by_name() {
        assert_eq!(full_and_finite(&[1.0, 2.0], 2, "parameters"), Ok(()));
        assert_eq!(
            full_and_finite(&[1.0], 2, "parameters"),
            Err(Rejection::WrongLength {
                what: "parameters",
                found: 1,
                expected: 2
            })
        );
        let error = full_and_finite(&[1.0, f32::NAN], 2, "center").unwrap_err();
        assert_eq!(error.to_string(), "center contain NaN or infinite values");
    }

    #[test]
    fn outliers_are_past_both_the_limit_and_the_floor() {
        let own = [3.0f32, 4.0]; // norm 5: the floor is 0.25
        // (distance, limit, outlier)
        let table = [
            (0.1, None, false),
            (100.0, None, false),
            (0.2, Some(0.1), false), // under the floor
            (0.3, Some(0.1), true),
            (0.3, Some(1.0), false),
            (f64::NAN, None, true),
        ];
        for (distance, limit, outlier) in table {
            assert_eq!(
                is_outlier(distance, limit, &own),
                outlier,
                "{distance} {limit:?}"
            );
        }
    }
}
